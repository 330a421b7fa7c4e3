"""The core's step ledger (gyre.train.core_state): one record per micro-batch, who holds each claim,
claims handed back by cells that leave, die or hang, and late results refused."""

import pytest
from _train_ref import random_batches

from gyre.control import messages as m
from gyre.models.config import ModelConfig
from gyre.train.core_state import CoreState, MicroBatch, OpenStep


def _claims(step: OpenStep, events: list) -> None:
    clock = iter(range(0, 1000, 10))  # each claim 10 s after the previous one
    held = {}
    for ev in events:
        if ev[0] == "claim":
            ms = step.claim(ev[1], now=next(clock))
            assert (ms.index if ms else None) == ev[2]
            held[(ev[1], ev[2])] = ms
        elif ev[0] == "overdue":
            assert step.overdue(now=ev[1], timeout_s=3) == ev[2]
        elif ev[0] == "complete":
            ms = held.get((ev[1], ev[2])) or next(m for m in held.values() if m and m.index == ev[2])
            assert step.complete(ms, ev[1]) is ev[3]
        else:
            assert [m.index for m in step.release(ev[1])] == ev[2]


@pytest.mark.parametrize(
    "events, claims, done_by, redone",
    [
        pytest.param(
            [("claim", "a", 0), ("claim", "b", 1), ("complete", "b", 1, True)], {0: "a"}, {1: "b"}, 0, id="two-cells"
        ),
        pytest.param(
            [("claim", "a", 0), ("release", "a", [0]), ("claim", "b", 0), ("complete", "b", 0, True)],
            {},
            {0: "b"},
            1,
            id="dead-cell-redone",
        ),
        pytest.param(
            [("claim", "a", 0), ("release", "a", [0]), ("claim", "b", 0), ("complete", "a", 0, False)],
            {0: "b"},
            {},
            1,
            id="late-result-of-presumed-dead-refused",
        ),
        pytest.param(
            [("claim", "a", 0), ("claim", "a", 1), ("claim", "a", None)], {0: "a", 1: "a"}, {}, 0, id="nothing-left"
        ),
        pytest.param(
            [
                ("claim", "a", 0),
                ("overdue", 5, {"a"}),
                ("release", "a", [0]),
                ("claim", "b", 0),
                ("overdue", 12, set()),
            ],
            {0: "b"},
            {},
            1,
            id="hung-cell-overdue",
        ),
        pytest.param(
            [
                ("claim", "a", 0),
                ("claim", "b", 1),
                ("release", "b", [1]),
                ("release", "a", [0]),
                ("claim", "c", 0),
                ("claim", "c", 1),
            ],
            {0: "c", 1: "c"},
            {},
            2,
            id="hand-backs-reclaimed-in-index-order",
        ),
    ],
)
def test_the_core_tracks_which_cell_holds_each_micro_batch(events, claims, done_by, redone):
    step = OpenStep(0)
    for index in range(2):
        step.batches.append(MicroBatch(index, (0, 10 + index, 0), None))
        step.ready.append(index)
    _claims(step, events)
    holders = {mb.index: mb.holder for mb in step.batches if mb.holder}
    done = {mb.index: mb.done_by for mb in step.batches if mb.done_by}
    assert (holders, done, step.redone) == (claims, done_by, redone)


def test_the_core_takes_one_micro_batch_by_index_and_folds_done_ones_in_order():
    """The core computes the next micro-batch to fold itself when no slot is free (`index`); only
    done micro-batches whose gradient waits in a slot fold, in index order."""
    step = OpenStep(0)
    for index in range(3):
        step.batches.append(MicroBatch(index, (0, 0, index), None))
        step.ready.append(index)
    assert step.claim("core", 0.0, index=1).index == 1 and step.claim("core", 0.0, index=1) is None
    first = step.claim("sat", 0.0)
    assert first.index == 0 and step.complete(first, "sat") and step.foldable() == []  # its slot: none yet
    first.slot = 4
    assert step.foldable() == [first] and step.folded == 1 and not step.complete_whole
    step.total_weight = 1.0
    assert not step.complete_whole and step.claim("sat", 0.0).index == 2


@pytest.mark.parametrize(
    "slots, replicas, events, peak",
    [
        pytest.param(
            1, 2, [("a", (0, 0, 0)), ("a", (1, 1, 0)), ("a", None)], 2, id="one-slot-a-replica-two-claims-at-once"
        ),
        pytest.param(
            2,
            2,
            [("a", (0, 0, 0)), ("a", (1, 1, 0)), ("a", None), ("b", (2, 0, 1)), ("b", (3, 1, 1)), ("b", None)],
            4,
            id="a-cell-holds-one-claim-a-replica",
        ),
        pytest.param(
            1,
            2,
            [("a", (0, 0, 0)), ("b", (1, 1, 0)), ("b", None), ("gone a", None), ("b", (0, 0, 0))],
            2,
            id="a-dead-cells-slot-reused-by-another",
        ),
        pytest.param(1, 1, [("a", (0, 0, 0)), ("b", None)], 1, id="one-replica-as-before"),
    ],
)
def test_gradient_slots_are_per_replica(slots, replicas, events, peak):
    """A layout of R replicas has K slots each: K x R claims in flight at K rows a core rank; a
    satellite's replicas each hold at most one claim, on a slot of the core's same replica.
    events: (cell, (index, replica, row) it is granted, or None: Wait), or ("gone X", None)."""
    state = CoreState(slots, version=0, num_replicas=replicas)
    state.step, (batch,) = OpenStep(0), random_batches(ModelConfig(), 1, 1, seed=0)
    for index in range(4):
        state.step.batches.append(MicroBatch(index, (0, 0, index), batch))
        state.step.ready.append(index)
    channels = {cell: object() for cell in "ab"}
    for cell, channel in channels.items():
        state.join(cell, channel)
    for cell, expected in events:
        if cell.startswith("gone "):
            state.gone(cell[5:], channels[cell[5:]])
            continue
        work = state.grant(cell)
        got = (work.index, work.replica, work.slot) if isinstance(work, m.Work) else None
        assert got == expected, (cell, expected)
    assert state.step.peak_in_flight == peak
