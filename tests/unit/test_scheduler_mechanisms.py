"""Each policy mechanism behind its switch keeps the invariants: never strands live work, never
moves the core out of a step, never exceeds the staleness bound, does not thrash."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.scheduler.cells import Role
from gyre.scheduler.config import SchedulerConfig
from gyre.scheduler.policy import CellView, Decision, ElasticPolicy, rebalance
from gyre.scheduler.streaming import MicroStepQueue, split_tokens
from tests.unit.test_scheduler_policy import _drive, cells, obs

VALUE = SchedulerConfig(leave_rule="value")
R, T = Role.ROLLOUT, Role.TRAIN

VALUE_CASES = [
    (
        "batch-ready-so-prefetch-is-deferrable: leaves although the whole waterlevel does not fit with headroom",
        obs(cells(T, R, R), running=95, running_ahead=60, ready_s=1e6, batch_ready=True),
        Decision(to_train=(1,)),
    ),
    (
        "batch-not-ready: the current rollout is the critical path, prefetch counts in full",
        obs(cells(T, R, R), running=95, running_ahead=60, ready_s=1e6),
        Decision(),
    ),
    (
        "every-live-session-keeps-a-place: 150 live on 100 slots and no tier -> stays",
        obs(cells(T, R, R), running=150, running_ahead=120, ready_s=1e6),
        Decision(),
    ),
    (
        "the-current-step-must-still-be-served-with-headroom",
        obs(cells(T, R, R), running=95, running_ahead=0, ready_s=1e6),
        Decision(),
    ),
    (
        "deferrable-decode-does-not-count: 1500 tok/s demand, 1000 of it ahead",
        obs(
            cells(T, R, R),
            running=50,
            running_ahead=30,
            demand=1500.0,
            gen_demand_ahead_tok_s=1000.0,
            ready_s=1e6,
            batch_ready=True,
        ),
        Decision(to_train=(1,)),
    ),
    ("work-must-pay-the-round-trip", obs(cells(T, R, R), running=10, running_ahead=10, ready_s=20.0), Decision()),
]


@pytest.mark.parametrize("o, expected", [pytest.param(o, e, id=i) for i, o, e in VALUE_CASES])
def test_value_leave_rule_cases(o, expected):
    assert ElasticPolicy(VALUE, len(o.cells)).decide(o) == expected


def test_the_waterlevel_rule_keeps_the_cell_where_the_value_rule_lets_it_go():
    o = VALUE_CASES[0][1]
    assert ElasticPolicy(SchedulerConfig(leave_rule="waterlevel"), len(o.cells)).decide(o) == Decision()


role_st = st.sampled_from([Role.ROLLOUT, Role.TRAIN, Role.TO_TRAIN, Role.TO_ROLLOUT])


@settings(max_examples=300, deadline=None)
@given(
    roles=st.lists(role_st, min_size=2, max_size=6),
    running=st.integers(0, 600),
    ahead=st.integers(0, 600),
    queued=st.integers(0, 600),
    ready_s=st.floats(0, 1e5),
    pooled=st.integers(0, 300),
    core_in_step=st.booleans(),
    batch_ready=st.booleans(),
)
def test_value_rule_never_strands_live_work_nor_moves_the_core(
    roles, running, ahead, queued, ready_s, pooled, core_in_step, batch_ready
):
    roles[0] = Role.TRAIN if core_in_step else roles[0]
    cs = cells(*roles, sessions=[running // len(roles)] * len(roles), in_step=(0,) if core_in_step else ())
    o = obs(
        cs,
        running=running,
        running_ahead=min(ahead, running),
        queued=queued,
        ready_s=ready_s,
        pooled_sessions=pooled,
        batch_ready=batch_ready,
    )
    d = ElasticPolicy(VALUE, len(cs)).decide(o)
    assert 0 not in d.to_train + d.to_rollout and not set(d.to_train) & set(d.to_rollout)
    if d.to_train:
        after = [c for c in cs if c.role in (Role.ROLLOUT, Role.TO_ROLLOUT) and c.index not in d.to_train]
        # every session has a place; with no live work at all, every satellite may train
        assert (after or running + queued == 0) and sum(c.max_sessions for c in after) + pooled >= running + queued


@pytest.mark.parametrize(
    "levels, max_switches",
    [
        ([175 + (10 if k % 2 else 0) for k in range(720)], 1),
        ([50 if k % 2 else 400 for k in range(720)], 0),
        ([50 if 30 <= k % 60 < 42 else 400 for k in range(720)], 0),
    ],
)
def test_value_rule_does_not_thrash(levels, max_switches):
    assert _drive(ElasticPolicy(VALUE, 4), levels) <= max_switches


def view(i, role, sessions, max_sessions=100):
    return CellView(index=i, role=role, is_core=(i == 0), sessions=sessions, max_sessions=max_sessions)


@pytest.mark.parametrize(
    "cs, target, expected",
    [
        pytest.param(
            (view(0, T, 0), view(1, R, 90), view(2, R, 60), view(3, R, 0)),
            3,
            {1: 40, 2: 10},
            id="most-loaded-gives-first",
        ),
        pytest.param((view(0, T, 0), view(1, R, 10), view(2, R, 0)), 2, {1: 5}, id="halves"),
        pytest.param((view(0, T, 0), view(1, R, 0), view(2, R, 0)), 2, {}, id="nothing-to-move"),
        pytest.param((view(0, T, 0), view(1, R, 50), view(2, T, 0)), 2, {}, id="target-not-serving-yet"),
        pytest.param(
            (view(0, T, 0), view(1, Role.TO_TRAIN, 50), view(2, R, 0)), 2, {}, id="a-leaving-cell-is-no-source"
        ),
    ],
)
def test_rebalance_evens_the_load_onto_a_returning_cell(cs, target, expected):
    moves = rebalance(cs, target)
    assert moves == expected
    assert all(next(c for c in cs if c.index == i).role == Role.ROLLOUT for i in moves)


@pytest.mark.parametrize(
    "tokens, bound, expected",
    [
        (10, 0, [10]),
        (10, 4, [4, 3, 3]),
        (8, 4, [4, 4]),
        (3, 10, [3]),
        (0, 4, []),
    ],
)
def test_split_tokens(tokens, bound, expected):
    assert split_tokens(tokens, bound) == expected and sum(expected) == tokens


def test_token_bounded_micro_steps_share_one_group_and_the_step_waits_for_every_part():
    q = MicroStepQueue(groups_per_step=1, staleness=1)
    q.add_ready(0, 0, 0, 10, max_tokens=4)
    assert q.batch_ready() and not q.step_complete()
    parts = [q.claim() for _ in range(3)]
    assert [p.tokens for p in parts] == [4, 3, 3] and q.claim() is None  # three cells can train at once
    for p in parts[:2]:
        q.complete(p)
    assert not q.step_complete()
    q.complete(parts[2])
    assert q.step_complete() and q.apply_optimizer_step() == 1


def test_mechanism_switches_are_validated():
    from gyre.errors import ConfigError

    for bad in ({"leave_rule": "greedy"}, {"admission": "eager"}, {"microstep_tokens": -1}):
        with pytest.raises(ConfigError) as err:
            replace(SchedulerConfig(), **bad)
        assert err.value.key == next(iter(bad))
