"""The waterlevel policy and the baselines on hand-built scenarios (tables of named cases)."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.scheduler.cells import Role
from gyre.scheduler.config import SchedulerConfig
from gyre.scheduler.policy import (
    AsyncPolicy,
    CellView,
    ColocatePolicy,
    Decision,
    ElasticPolicy,
    Observation,
    balanced_train_cells,
    make_policy,
)

# seed's switch costs: round trip 11.98 s, gain_factor 2 -> 23.96 s; the waterlevel rule alone (the
# value rule's cases and invariants: test_scheduler_mechanisms.py)
CFG = SchedulerConfig(leave_rule="waterlevel")
R, T = Role.ROLLOUT, Role.TRAIN


def cells(*roles, sessions=None, since_s=0.0, in_step=()):
    """Cell 0 is the core; every cell serves up to 100 sessions at 1000 tokens/s."""
    sessions = sessions or [0] * len(roles)
    return tuple(
        CellView(
            index=i,
            role=r,
            is_core=(i == 0),
            in_step=(i in in_step),
            since_s=since_s,
            sessions=sessions[i],
            max_sessions=100,
            gen_tok_s=1000.0,
        )
        for i, r in enumerate(roles)
    )


def obs(cs, running=0, queued=0, ready_s=0.0, now_s=1000.0, demand=0.0, **kw):
    return Observation(
        now_s=now_s, cells=cs, queued=queued, running=running, gen_demand_tok_s=demand, ready_train_s=ready_s, **kw
    )


ELASTIC_CASES = [
    # id, observation, expected decision
    (
        "spare-capacity-and-work-pays: one satellite leaves",
        obs(cells(T, R, R, R, sessions=[0, 40, 40, 40]), running=120, ready_s=1000.0),
        Decision(to_train=(1,)),
    ),
    (
        "plenty-spare: two leave, the emptiest first",
        obs(cells(T, R, R, R, sessions=[0, 30, 5, 10]), running=45, ready_s=1000.0),
        Decision(to_train=(2, 3)),
    ),
    (
        "gain-below-cost: stays (10 s of work < 2 x 11.98 s)",
        obs(cells(T, R, R, R), running=10, ready_s=20.0),
        Decision(),
    ),
    ("no-training-work: stays", obs(cells(T, R, R, R), running=10, ready_s=0.0), Decision()),
    ("last-rollout-cell-with-live-work: stays", obs(cells(T, R), running=1, ready_s=1e6), Decision()),
    ("remaining-cells-too-small-for-sessions: stays", obs(cells(T, R, R), running=150, ready_s=1e6), Decision()),
    (
        "pooled-offload-tier-holds-the-rest: one leaves (100 + 100 pooled >= 150 x 1.1)",
        obs(cells(T, R, R), running=150, ready_s=1e6, pooled_sessions=100),
        Decision(to_train=(1,)),
    ),
    (
        "remaining-cells-too-slow-for-tokens: stays",
        obs(cells(T, R, R), running=50, demand=1500.0, ready_s=1e6),
        Decision(),
    ),
    (
        "headroom-counts: 95 live sessions do not fit 100 slots with 10% to spare",
        obs(cells(T, R, R), running=95, ready_s=1e6),
        Decision(),
    ),
    ("dwell-not-elapsed: stays", obs(cells(T, R, R, R, since_s=990.0), running=10, ready_s=1e6), Decision()),
    (
        "queue-outgrew-serving: the needed satellites return",
        obs(cells(T, T, T, R), running=100, queued=150, ready_s=1e6),
        Decision(to_rollout=(1, 2)),
    ),
    ("small-queue-below-threshold: no return", obs(cells(T, T, R), running=100, queued=10), Decision()),
    ("queue-but-serving-cells-absorb-it: no return", obs(cells(T, T, R, R), running=100, queued=30), Decision()),
    (
        "return-prefers-cells-between-micro-steps",
        obs(cells(T, T, T, R, in_step=(1,)), running=100, queued=60),
        Decision(to_rollout=(2,)),
    ),
    ("core-never-returns-to-rollout", obs(cells(T, R), running=100, queued=500), Decision()),
    (
        "serving-cell-lost: a satellite returns at once, dwell and queue threshold or not",
        obs(cells(T, T, T, Role.LOST, since_s=990.0, in_step=(1,)), running=3, ready_s=1e6),
        Decision(to_rollout=(2,)),
    ),
    (
        "serving-cell-lost-and-no-live-work: nothing returns",
        obs(cells(T, T, Role.LOST), running=0, ready_s=1e6),
        Decision(),
    ),
    (
        "lost-cells-are-never-chosen-nor-counted",
        obs(cells(T, Role.LOST, R, R, sessions=[0, 0, 10, 10]), running=20, ready_s=1e6),
        Decision(to_train=(2,)),
    ),
]


@pytest.mark.parametrize("o, expected", [pytest.param(o, e, id=i) for i, o, e in ELASTIC_CASES])
def test_elastic_cases(o, expected):
    assert ElasticPolicy(CFG, len(o.cells)).decide(o) == expected


CRITICAL_PATH_CASES = [
    # Executions queued for later steps (queued_ahead) are prefetch when critical_path is on.
    (
        "prefetch-queue-does-not-block-leaving",
        obs(cells(T, R, R, R, sessions=[0, 40, 40, 40]), running=120, queued=300, queued_ahead=300, ready_s=1000.0),
        Decision(to_train=(1,)),
    ),
    (
        "prefetch-queue-leaves-cells-on-ready-work",
        obs(cells(T, T, R), running=100, queued=200, queued_ahead=200, ready_s=1000.0),
        Decision(),
    ),
    (
        "prefetch-queue-and-no-work-left: idle cells come back",
        obs(cells(T, T, T, R, in_step=(2,)), running=100, queued=200, queued_ahead=200, ready_s=0.0),
        Decision(to_rollout=(1,)),
    ),
    (
        "queue-for-the-current-step-pulls-back-even-with-work",
        obs(cells(T, T, R), running=100, queued=200, queued_ahead=0, ready_s=1000.0),
        Decision(to_rollout=(1,)),
    ),
]


@pytest.mark.parametrize("o, expected", [pytest.param(o, e, id=i) for i, o, e in CRITICAL_PATH_CASES])
def test_critical_path_cases(o, expected):
    assert ElasticPolicy(replace(CFG, critical_path=True), len(o.cells)).decide(o) == expected


def test_plain_waterlevel_counts_prefetch_as_live_work():
    o = obs(cells(T, R, R, R, sessions=[0, 40, 40, 40]), running=120, queued=300, queued_ahead=300, ready_s=1000.0)
    assert ElasticPolicy(CFG, 4).decide(o) == Decision()
    assert ElasticPolicy(CFG, 4).decide(replace(o, queued=0, queued_ahead=0)) == Decision(to_train=(1,))


RELIEVE_CASES = [
    # Two serving cells decode 2000 tokens/s; demand 3000 is a one-cell deficit that slows every session.
    (
        "decode-overloaded-and-training-starved: the idle satellite returns",
        obs(cells(T, T, R, R), running=100, demand=3000.0),
        Decision(to_rollout=(1,)),
    ),
    ("training-has-a-backlog: stays", obs(cells(T, T, R, R), running=100, demand=3000.0, ready_s=1000.0), Decision()),
    (
        "next-step-batch-complete: its ready work counts as backlog: stays",
        obs(cells(T, T, R, R), running=100, demand=3000.0, ready_ahead_train_s=1000.0),
        Decision(),
    ),
    # The current step's batch is trained (its optimizer step runs), the next step's early groups are
    # ready, but its other executions still run: training would run dry after those groups anyway.
    (
        "next-step-executions-still-running: its early groups hold no idle satellite: returns",
        obs(
            cells(T, T, R, R),
            running=100,
            running_ahead=100,
            demand=3000.0,
            ready_ahead_train_s=1000.0,
            batch_ready=True,
            step_open=True,
        ),
        Decision(to_rollout=(1,)),
    ),
    (
        "next-step-executions-still-queued: returns",
        obs(cells(T, T, R, R), running=100, queued=20, queued_ahead=20, demand=3000.0, ready_ahead_train_s=1000.0),
        Decision(to_rollout=(1,)),
    ),
    (
        "next-step-executions-live-but-current-step-work-ready: stays",
        obs(
            cells(T, T, R, R), running=100, running_ahead=100, demand=3000.0, ready_s=1000.0, ready_ahead_train_s=1000.0
        ),
        Decision(),
    ),
    ("satellite-in-a-micro-step: stays", obs(cells(T, T, R, R, in_step=(1,)), running=100, demand=3000.0), Decision()),
    (
        "deficit-too-small-to-pay-the-round-trip (0.2 cell x 60 s < 24 s): stays",
        obs(cells(T, T, R, R), running=100, demand=2200.0),
        Decision(),
    ),
    ("two-cell-deficit: two return", obs(cells(T, T, T, R), running=100, demand=3000.0), Decision(to_rollout=(1, 2))),
    ("dwell-not-elapsed: stays", obs(cells(T, T, R, R, since_s=990.0), running=100, demand=3000.0), Decision()),
]


@pytest.mark.parametrize("o, expected", [pytest.param(o, e, id=i) for i, o, e in RELIEVE_CASES])
def test_relieve_cases(o, expected):
    assert ElasticPolicy(CFG, len(o.cells)).decide(o) == expected


def test_a_brief_demand_spike_brings_no_cell_back():
    pol = ElasticPolicy(CFG, 4)
    calm = obs(cells(T, T, R, R), running=100, demand=1000.0, now_s=1000.0)
    assert pol.decide(calm) == Decision()
    assert pol.decide(replace(calm, now_s=1200.0, gen_demand_tok_s=3000.0)) == Decision()  # min over 300 s: 1000
    assert pol.decide(replace(calm, now_s=1310.0, gen_demand_tok_s=3000.0)) == Decision(to_rollout=(1,))


COLOCATE_CASES = [
    ("rolling-out-batch-not-ready: nothing", obs(cells(R, R, R)), Decision()),
    (
        "batch-ready: every cell trains, the core too",
        obs(cells(R, R, R), batch_ready=True),
        Decision(to_train=(0, 1, 2)),
    ),
    ("step-open: keep training", obs(cells(T, T, T, in_step=(0,)), step_open=True), Decision()),
    ("step-applied-next-not-ready: every cell returns", obs(cells(T, T, T)), Decision(to_rollout=(0, 1, 2))),
    ("core-in-step-is-never-moved", obs(cells(T, T, in_step=(0,))), Decision(to_rollout=(1,))),
    ("lost-cell-is-left-alone", obs(cells(R, Role.LOST, R), batch_ready=True), Decision(to_train=(0, 2))),
]


@pytest.mark.parametrize("o, expected", [pytest.param(o, e, id=i) for i, o, e in COLOCATE_CASES])
def test_colocate_cases(o, expected):
    assert ColocatePolicy(CFG, len(o.cells)).decide(o) == expected


@pytest.mark.parametrize(
    "num_cells, share, expected",
    [
        pytest.param(4, 0.5, 2, id="half"),
        pytest.param(4, 0.01, 1, id="at-least-the-core"),
        pytest.param(4, 0.99, 3, id="at-least-one-rollout"),
        pytest.param(6, 0.21, 1, id="rounds"),
    ],
)
def test_async_pools_balance_the_work(num_cells, share, expected):
    assert balanced_train_cells(num_cells, share) == expected
    pol = make_policy(replace(CFG, mode="async", async_split="work_share"), num_cells, share)
    assert isinstance(pol, AsyncPolicy) and pol.initial_roles().count(Role.TRAIN) == expected
    assert pol.decide(obs(cells(*pol.initial_roles()), running=0, ready_s=1e9)) == Decision()


def test_async_replaces_a_rollout_pool_that_was_lost_and_only_then():
    pol = make_policy(replace(CFG, mode="async", async_train_cells=2), 3)
    assert pol.decide(obs(cells(T, T, Role.LOST), running=4)) == Decision(to_rollout=(1,))
    assert pol.decide(obs(cells(T, T, Role.LOST), running=0)) == Decision()
    assert pol.decide(obs(cells(T, T, R), running=400, queued=400)) == Decision()


@pytest.mark.parametrize("num_cells, expected", [(4, 2), (5, 2), (6, 3), (8, 4), (2, 1)])
def test_async_default_split_is_even_whatever_the_work(num_cells, expected):
    pol = make_policy(replace(CFG, mode="async"), num_cells, train_share=0.9)
    assert pol.initial_roles().count(Role.TRAIN) == expected


def test_initial_roles_per_mode():
    assert make_policy(CFG, 3).initial_roles() == [T, R, R]
    assert make_policy(replace(CFG, mode="colocate"), 3).initial_roles() == [R, R, R]
    assert make_policy(replace(CFG, mode="async", async_train_cells=2), 3).initial_roles() == [T, T, R]
    with pytest.raises(ValueError, match="train cells"):
        make_policy(replace(CFG, mode="async", async_train_cells=3), 3)


role_st = st.sampled_from([Role.ROLLOUT, Role.TRAIN, Role.TO_TRAIN, Role.TO_ROLLOUT])


@settings(max_examples=300, deadline=None)
@given(
    roles=st.lists(role_st, min_size=2, max_size=6),
    running=st.integers(0, 600),
    queued=st.integers(0, 600),
    ready_s=st.floats(0, 1e5),
    mode=st.sampled_from(["elastic", "colocate"]),
    batch_ready=st.booleans(),
    core_in_step=st.booleans(),
)
def test_never_strands_live_work_nor_moves_the_core_out_of_a_step(
    roles, running, queued, ready_s, mode, batch_ready, core_in_step
):
    roles[0] = Role.TRAIN if core_in_step else roles[0]
    cs = cells(*roles, sessions=[running // len(roles)] * len(roles), in_step=(0,) if core_in_step else ())
    o = obs(cs, running=running, queued=queued, ready_s=ready_s, batch_ready=batch_ready and mode == "colocate")
    d = make_policy(replace(CFG, mode=mode), len(cs)).decide(o)
    assert not (core_in_step and 0 in d.to_train + d.to_rollout), "the core left a step it is part of"
    assert not set(d.to_train) & set(d.to_rollout)
    if mode == "elastic":
        assert 0 not in d.to_train + d.to_rollout
        serving_before = [c for c in cs if c.role in (Role.ROLLOUT, Role.TO_ROLLOUT)]
        serving_after = [c for c in serving_before if c.index not in d.to_train]
        satellites = [c for c in cs if c.role == Role.TRAIN and c.index]
        if running + queued and not serving_before and satellites:
            assert d.to_rollout, "live work and no serving cell: a satellite must come back"
        if d.to_train:  # a leave happens only if the rest serve every live execution, with headroom
            assert running + queued == 0 or sum(c.max_sessions for c in serving_after) >= (running + queued) * 1.1


def _drive(policy, waterlevels, tick_s=10.0, capacity=100):
    """Apply the policy's decisions tick by tick (switches take the configured costs); count switches."""
    roles = policy.initial_roles()
    since = [0.0] * len(roles)
    pending: dict[int, tuple[float, Role]] = {}
    switches = 0
    for k, w in enumerate(waterlevels):
        now = k * tick_s
        for i, (done_at, role) in list(pending.items()):
            if now >= done_at:
                roles[i], since[i] = role, now
                del pending[i]
        view = tuple(
            CellView(index=i, role=r, is_core=(i == 0), since_s=since[i], max_sessions=capacity, gen_tok_s=1e9)
            for i, r in enumerate(roles)
        )
        serving = sum(capacity for r in roles if r in (Role.ROLLOUT, Role.TO_ROLLOUT))
        o = Observation(now_s=now, cells=view, running=min(w, serving), queued=max(0, w - serving), ready_train_s=1e6)
        d = policy.decide(o)
        for i in d.to_train:
            roles[i], since[i] = Role.TO_TRAIN, now
            pending[i] = (now + policy.cfg.rollout_to_train_s, Role.TRAIN)
        for i in d.to_rollout:
            roles[i], since[i] = Role.TO_ROLLOUT, now
            pending[i] = (now + policy.cfg.train_to_rollout_s, Role.ROLLOUT)
        switches += len(d.to_train) + len(d.to_rollout)
    return switches


@pytest.mark.parametrize(
    "name, levels, max_switches",
    [
        # 3 satellites of 100 sessions; leaving one needs W <= 200/1.1 = 181, returning needs a queue of 25.
        pytest.param(
            "small-wobble-around-leave-threshold",
            [175 + (10 if k % 2 else 0) for k in range(720)],
            1,
            id="small-wobble-around-leave-threshold",
        ),
        pytest.param(
            "wobble-around-return-threshold",
            [190 + (30 if k % 2 else 0) for k in range(720)],
            1,
            id="wobble-around-return-threshold",
        ),
        # Brief dips inside the 300 s leave window never send a cell away.
        pytest.param(
            "full-swing-every-tick", [50 if k % 2 else 400 for k in range(720)], 0, id="full-swing-every-tick"
        ),
        pytest.param(
            "dip-for-two-minutes-every-ten",
            [50 if 30 <= k % 60 < 42 else 400 for k in range(720)],
            0,
            id="dip-for-two-minutes-every-ten",
        ),
    ],
)
def test_no_thrashing_under_an_oscillating_waterlevel(name, levels, max_switches):
    assert _drive(ElasticPolicy(CFG, 4), levels) <= max_switches


def test_switches_follow_lasting_changes():
    # Ten low minutes, then ten high ones: two satellites leave (the last one keeps serving the 20
    # live executions), and both come back once.
    assert _drive(ElasticPolicy(CFG, 4), [20] * 60 + [400] * 60) == 4


def test_without_hysteresis_the_same_wobble_thrashes():
    """The anti-thrash test above can fail: with no window and no dwell the policy flips every minute."""
    loose = replace(CFG, leave_window_s=0.0, min_dwell_s=0.0)
    assert _drive(ElasticPolicy(loose, 4), [50 if k % 6 < 3 else 400 for k in range(720)]) > 100
