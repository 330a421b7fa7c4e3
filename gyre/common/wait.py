"""Waiting for a condition with a deadline: the one poll loop, for threads (`wait_until`) and for
coroutines (`wait_until_async`). Conditions may raise to stop waiting."""

import asyncio
import time
from collections.abc import Awaitable, Callable


def wait_until(condition: Callable[[], object], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll `condition` every `interval_s` until it is truthy (True) or `timeout_s` has passed (False,
    after one last look). An exception from `condition` ends the wait and propagates: a child that
    died while we waited for its port, say."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return bool(condition())
        time.sleep(interval_s)
    return True


async def wait_until_async(
    condition: Callable[[], Awaitable[object]], timeout_s: float, interval_s: float = 0.05
) -> bool:
    """`wait_until` for a coroutine condition (an HTTP probe, say), sleeping without blocking the loop."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            return bool(await condition())
        await asyncio.sleep(interval_s)
    return True
