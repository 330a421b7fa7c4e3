"""wait_until, wait_until_async: the one poll loop with a deadline."""

import asyncio

import pytest

from gyre.common.wait import wait_until, wait_until_async


def test_a_condition_met_returns_true_one_never_met_false_and_an_error_ends_the_wait():
    calls = iter([False, False, True])
    assert wait_until(lambda: next(calls), timeout_s=5, interval_s=0.001)
    assert not wait_until(lambda: False, timeout_s=0.01, interval_s=0.001)

    def gone():
        raise RuntimeError("the child died")

    with pytest.raises(RuntimeError, match="died"):
        wait_until(gone, timeout_s=5)


def test_the_async_wait_returns_true_once_met_false_at_its_deadline_and_an_error_ends_it():
    calls = iter([False, False, True])

    async def met_third_time() -> bool:
        return next(calls)

    async def never() -> bool:
        return False

    async def gone() -> bool:
        raise RuntimeError("the child died")

    assert asyncio.run(wait_until_async(met_third_time, timeout_s=5, interval_s=0.001))
    assert not asyncio.run(wait_until_async(never, timeout_s=0.01, interval_s=0.001))
    with pytest.raises(RuntimeError, match="died"):
        asyncio.run(wait_until_async(gone, timeout_s=5))
