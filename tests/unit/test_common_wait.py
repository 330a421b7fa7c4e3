"""wait_until: the one poll loop with a deadline."""

import pytest

from gyre.common.wait import wait_until


def test_a_condition_met_returns_true_one_never_met_false_and_an_error_ends_the_wait():
    calls = iter([False, False, True])
    assert wait_until(lambda: next(calls), timeout_s=5, interval_s=0.001)
    assert not wait_until(lambda: False, timeout_s=0.01, interval_s=0.001)

    def gone():
        raise RuntimeError("the child died")

    with pytest.raises(RuntimeError, match="died"):
        wait_until(gone, timeout_s=5)
