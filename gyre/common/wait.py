"""Waiting for a condition with a deadline: the one poll loop (conditions may raise to stop waiting)."""

import time
from collections.abc import Callable


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
