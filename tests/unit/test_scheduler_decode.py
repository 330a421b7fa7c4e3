"""The live decode measurement (gyre.scheduler.decode) and what it changes in the policy's decisions."""

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest

from gyre.coordinator.loop import observe
from gyre.scheduler.cells import Cell, Role
from gyre.scheduler.config import SchedulerConfig
from gyre.scheduler.decode import DecodeMeter, measure_cells, session_capacity
from gyre.scheduler.policy import ElasticPolicy
from gyre.scheduler.streaming import MicroStepQueue


def engine(eid, tokens=0, call_s=0.0, busy_s=0.0, sessions=0, context=0, kv=0):
    """One entry of /admin/metrics' engines (gyre.proxy.pool.EnginePool.describe)."""
    return {
        "engine_id": eid,
        "output_tokens": tokens,
        "call_s": call_s,
        "busy_s": busy_s,
        "num_sessions": sessions,
        "context_tokens": context,
        "kv_capacity_tokens": kv,
    }


def feed(meter, samples):
    """Feed (t, [engine, ...]) samples; returns the last update's calls in flight per engine."""
    calls = {}
    for t, engines in samples:
        calls = meter.update(t, engines)
    return calls


ALONE = (10.0, [engine("e1", 600, 10.0, 10.0)])  # one call for 10 s at 60 tokens/s
SLOWED_16 = (20.0, [engine("e1", 600 + 4800, 170.0, 20.0)])  # then 16 calls at 30 tokens/s each

METER_CASES = [
    # id, samples after t=0 with zero counters, session_tok_s, cap of e1 (None: not measured), calls of e1
    ("alone-at-full-speed: speed, no cap", [ALONE], 60.0, None, 1.0),
    ("slowed-calls-delivered-the-cap", [ALONE, SLOWED_16], 60.0, 480.0, 16.0),
    (
        "too-few-call-seconds-measure-nothing",
        [(10.0, [engine("e1", 300, 0.4, 0.4)])],
        0.0,
        None,
        0.04,
    ),
    (
        "restarted-counters-are-skipped",
        [ALONE, (20.0, [engine("e1", 5, 0.1, 0.1)])],
        60.0,
        None,
        None,
    ),
    (
        "calls-waiting-without-a-token-are-no-cap (prefill or a stall: a cap of 0 stranded the policy)",
        [ALONE, (20.0, [engine("e1", 600, 170.0, 20.0)])],
        60.0,
        None,
        16.0,
    ),
    (
        "window-forgets-old-samples: the mean over the last 10 s",
        [ALONE, (20.0, [engine("e1", 1200, 20.0, 20.0)]), (30.0, [engine("e1", 1200, 20.0, 20.0)])],
        60.0,
        None,
        0.0,
    ),
]


@pytest.mark.parametrize("samples,speed,cap,calls", [c[1:] for c in METER_CASES], ids=[c[0] for c in METER_CASES])
def test_meter_cases(samples, speed, cap, calls):
    meter = DecodeMeter(window_s=10.0)
    got = feed(meter, [(0.0, [engine("e1")]), *samples])
    assert meter.session_tok_s == pytest.approx(speed)
    assert meter.cap_tok_s.get("e1") == (None if cap is None else pytest.approx(cap))
    assert got.get("e1") == (None if calls is None else pytest.approx(calls))


def test_an_engine_not_measured_gets_the_mean_cap_of_the_others_else_its_sessions_at_full_speed():
    meter = DecodeMeter(window_s=10.0)
    feed(meter, [(0.0, [engine("e1")]), ALONE])
    assert meter.capacity("e2", max_sessions=32) == pytest.approx(32 * 60.0)
    feed(meter, [SLOWED_16])
    assert meter.capacity("e2", max_sessions=32) == pytest.approx(480.0)


def test_a_cell_of_two_engines_is_one_cell_with_its_engines_sessions_and_decode_capacity_summed():
    meter = DecodeMeter(window_s=10.0)
    feed(meter, [(0.0, [engine("a"), engine("b"), engine("c")])])
    # a: one call alone at 60 tokens/s; b: 16 calls at 30 tokens/s each (its cap, 480 tokens/s, binds)
    now = [engine("a", 600, 10.0, 10.0, sessions=3), engine("b", 4800, 160.0, 10.0, sessions=16), engine("c")]
    loads = measure_cells(10.0, [["a", "b"], ["c"]], now, meter, sessions_per_cell=32)
    assert loads.sessions == [19, 0] and loads.max_sessions == [32, 32]  # within sessions_per_cell
    assert loads.gen_tok_s == [pytest.approx(480.0 + 480.0), pytest.approx(480.0)]  # a, c: the mean cap


CAPACITY_CASES = [
    ("no-kv-reported: configured", engine("e", sessions=4, context=40_000), 32),
    ("no-context-yet: configured", engine("e", kv=100_000), 32),
    ("kv-binds: 100k tokens over 20k-token sessions", engine("e", sessions=4, context=80_000, kv=100_000), 5),
    ("configured-binds", engine("e", sessions=4, context=4_000, kv=100_000), 32),
    ("one-session-larger-than-memory: still one", engine("e", sessions=1, context=300_000, kv=100_000), 1),
]


@pytest.mark.parametrize("eng,expected", [c[1:] for c in CAPACITY_CASES], ids=[c[0] for c in CAPACITY_CASES])
def test_session_capacity_cases(eng, expected):
    assert session_capacity(32, eng) == expected


class _Admin:
    """The proxy's admin API as the loop reads it: one /admin/metrics answer per tick."""

    def __init__(self):
        self.engines = []

    async def metrics(self):
        return {"engines": self.engines}


def _observations(running_ahead: int = 0):
    """A run where one serving cell's 16 calls run at half speed (`running_ahead` of them for a
    later step), training has no ready work and a satellite idles in training: each tick's
    observation as the coordinator's loop builds it (gyre.coordinator.loop.observe) from the
    proxy's counters."""
    cells = [
        SimpleNamespace(state=Cell(0, 1, is_core=True, role=Role.TRAIN, since_s=-100.0), engine_ids=["e0"]),
        SimpleNamespace(state=Cell(1, 1, role=Role.ROLLOUT, since_s=-100.0), engine_ids=["e1"]),
        SimpleNamespace(state=Cell(2, 1, role=Role.TRAIN, since_s=-100.0), engine_ids=["e2"]),
    ]
    parts = SimpleNamespace(cells=cells, admin=_Admin(), decode=DecodeMeter(window_s=10.0))
    train = MicroStepQueue(groups_per_step=1, staleness=1)  # the ready work (gyre.scheduler.observe.ReadyWork)
    train.train_tok_s, train.optimizing = 2000.0, False
    source = SimpleNamespace(counts=lambda version: (0, 0, 16, running_ahead))
    cfg = SimpleNamespace(coordinator=SimpleNamespace(sessions_per_cell=32))
    out = []
    for t in range(0, 60, 10):
        # t=10: one call alone at 60 tokens/s; then 16 calls, 480 tokens/s together
        tokens, call_s = (0, 0.0) if t == 0 else (600 + 480 * (t - 10), 10.0 + 16 * (t - 10))
        parts.admin.engines = [engine("e1", tokens, call_s, float(t), sessions=16), engine("e2")]
        out.append(asyncio.run(observe(cfg, parts, train, source, float(t)))[0])
    return out


def test_a_later_steps_running_executions_reach_the_policy_with_their_share_of_the_demand():
    """What the simulator has always shown the policy, the live loop now shows too: executions of a
    later step running, and their decode demand (pro rata: 4 of 16 calls draw 240 of 960 tokens/s)."""
    o = _observations(running_ahead=4)[-1]
    assert o.running == 16 and o.running_ahead == 4
    assert o.gen_demand_ahead_tok_s == pytest.approx(o.gen_demand_tok_s / 4) and o.gen_demand_tok_s == pytest.approx(
        960
    )
    assert _observations()[-1].gen_demand_ahead_tok_s == 0.0


def test_no_measured_decode_capacity_brings_no_satellite_back():
    """Every cell's decode capacity 0 (nothing decoded yet where calls wait): the policy cannot weigh
    demand against capacity, so it brings nothing back (it divided by zero on a Slurm run)."""
    o = _observations()[-1]
    zero = replace(o, cells=tuple(replace(c, gen_tok_s=0.0) for c in o.cells))
    policy = ElasticPolicy(SchedulerConfig(leave_window_s=15.0, min_dwell_s=60.0), num_cells=3)
    assert policy.decide(zero).to_rollout == ()


def _constants(o):
    """`o` with the decode terms as the live coordinator passed them before they were measured."""
    return replace(o, gen_demand_tok_s=0.0, cells=tuple(replace(c, gen_tok_s=1.0) for c in o.cells))


@pytest.mark.parametrize("measured,expected", [(True, (2,)), (False, ())], ids=["measured", "constants"])
def test_measured_decode_terms_bring_a_satellite_back_to_relieve_slowed_sessions(measured, expected):
    """With the proxy's counters the policy sees 16 calls drawing 960 tokens/s from a cell that
    delivers 480, and brings the idle satellite back (its sessions run at half speed); with the
    decode terms as constants it sees no overload and keeps it training."""
    observations = _observations()
    assert observations[-1].gen_demand_tok_s == pytest.approx(960.0)
    assert [c.gen_tok_s for c in observations[-1].cells] == pytest.approx([480.0] * 3)
    policy = ElasticPolicy(SchedulerConfig(leave_window_s=15.0, min_dwell_s=60.0), num_cells=3)
    decisions = [policy.decide(o if measured else _constants(o)) for o in observations]
    assert decisions[-1].to_rollout == expected
    assert not any(d.to_train for d in decisions)
