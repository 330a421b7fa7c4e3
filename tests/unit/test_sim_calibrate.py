"""Calibration reads a live run's files back as the simulator's overrides: a synthetic run directory
with known call times, token counts and training rates must come back as exactly those values."""

import shutil
from dataclasses import asdict, replace

import pytest
import yaml

from gyre.coordinator.ledger import ExecutionLedger, LedgerEntry
from gyre.metrics.events import (
    Checkpoint,
    ExecutionState,
    MicroStepEvent,
    ObservationEvent,
    OptimizerStep,
    RoleSwitchEvent,
    RunStart,
    WeightPublish,
)
from gyre.metrics.log import EventLog
from gyre.records.io import RecordWriter
from gyre.records.record import CallRecord
from gyre.scheduler.config import SchedulerConfig
from gyre.sim.calibrate import (
    CalibrationError,
    blocked_s,
    compose_sim,
    live_wall,
    load_run,
    make_overrides,
    measure_start_s,
    peak_rate,
    predict,
)
from gyre.sim.config import PresetConfig

T0 = 1000.0
# execution -> (cell, running at, outcome, outcome at, calls as (start, end, input, cached, output)).
# Cell 1 serves one call at a time at 10 output tokens/s and 100 prefill tokens/s
# (duration = output / 10 + (input - cached) / 100); cell 2 serves two calls at once, 20 tokens/s in all.
EXECUTIONS = {
    "g00000-0": (1, 0.0, "finished", 9.0, [(1.0, 4.0, 100, 0, 20), (6.0, 7.1, 130, 120, 10)]),
    "g00000-1": (1, 10.0, "timed_out", 17.0, [(10.5, 15.5, 200, 0, 30), (16.0, 16.5, 240, 240, 5)]),
    "g00000-2": (2, 0.0, "finished", 6.0, [(1.0, 5.0, 50, 50, 40)]),
    "g00000-3": (2, 0.0, "excluded", 6.0, [(1.0, 5.0, 50, 50, 40)]),
}
PACKED_TOKENS = 1000
LAST_STEP_AT = 30.0


def _call(eid: str, i: int, cell: int, start, end, n_in, cached, n_out) -> CallRecord:
    return CallRecord.build(
        execution_id=eid,
        call_id=f"c{i}",
        seq=i,
        agent_id="main",
        parent_agent_id=None,
        kind_hint="main",
        input_ids=list(range(n_in)),
        output_ids=[1] * n_out,
        logprobs=[-0.5] * n_out,
        versions=[0] * n_out,
        finish_reason="stop",
        engine_id=f"cell{cell}",
        cell_id=str(cell),
        started_at=T0 + start,
        finished_at=T0 + end,
        hints={"cached_tokens": cached},
    )


def _optimizer_step() -> OptimizerStep:
    return OptimizerStep(
        t=T0 + LAST_STEP_AT,
        step=0,
        loss=0.0,
        clip_fraction=0.0,
        truncated_fraction=0.0,
        ratio_mean=1.0,
        logprob_gap_mean=0.0,
        entropy_mean=None,
        grad_norm=1.0,
        reward_mean=0.5,
        reward_std=0.1,
        num_executions=3,
        targets_naive=1,
        targets_capped=1,
        targets_dedup=1,
        seq_tokens_packed=PACKED_TOKENS,
        seconds=5.0,
    )


def write_run(d, num_steps: int = 1):
    """A finished one-step elastic run of one group of four on three cells."""
    (d / ".hydra").mkdir(parents=True)
    config = {
        "cluster": {"num_cells": 3, "cell_nodes": 1},
        "coordinator": {
            "groups_per_step": 1,
            "group_size": 4,
            "sessions_per_cell": 4,
            "tick_s": 0.5,
            "max_micro_batch_tokens": 8192,
        },
        "engine": {"prefix_cache_tokens": 65536},
        "scheduler": asdict(SchedulerConfig(mode="elastic")),
        "num_steps": num_steps,
        "seed": 0,
    }
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (d / "records").mkdir()
    ledger = ExecutionLedger(d / "ledger.jsonl")
    for eid, (cell, running, outcome, ended, calls) in EXECUTIONS.items():
        with RecordWriter(d / "records" / f"{eid}.jsonl") as w:
            for i, c in enumerate(calls):
                w.append(_call(eid, i, cell, *c))
        ledger.append(LedgerEntry(eid, "queued", T0 - 1, group=0, task_id="t"))
        ledger.append(LedgerEntry(eid, "running", T0 + running, group=0, task_id="t"))
        ledger.append(
            LedgerEntry(
                eid,
                outcome,
                T0 + ended,
                group=0,
                task_id="t",
                duration_s=ended - running,
                reason="no_score" if outcome == "excluded" else "",
            )
        )
        if outcome != "excluded":
            ledger.append(LedgerEntry(eid, "trained", T0 + 31, group=0, task_id="t", step=0))
    ledger.close()
    with EventLog(d) as log:
        log.emit(RunStart(t=T0 - 1, mode="elastic", num_steps=num_steps, num_cells=3))
        log.emit(
            RoleSwitchEvent(
                t=T0 + 20,
                cell=1,
                from_role="rollout",
                to_role="train",
                t_start=T0 + 18.8,
                phases={"stop_admission": 0.2, "pull_weights": 1.0},
            )
        )
        log.emit(
            RoleSwitchEvent(
                t=T0 + 25,
                cell=1,
                from_role="train",
                to_role="rollout",
                t_start=T0 + 21,
                phases={"finish_microstep": 3.0, "stop_admission": 0.4, "load_weights": 0.6},
            )
        )
        log.emit(MicroStepEvent(t=T0 + LAST_STEP_AT, step=0, index=0, cell=0, tokens=600, seconds=2.0))
        log.emit(MicroStepEvent(t=T0 + LAST_STEP_AT, step=0, index=1, cell=1, tokens=400, seconds=1.0))
        log.emit(_optimizer_step())
        log.emit(WeightPublish(t=T0 + LAST_STEP_AT, version=1, seconds=0.5, num_engines=1))
        log.emit(Checkpoint(t=T0 + LAST_STEP_AT + 1.5, step=1, path="ckpt", seconds=1.5))
    return d


def _values(overrides: list[str]) -> dict[str, str]:
    return dict(o.lstrip("+").split("=", 1) for o in overrides)


@pytest.fixture
def run_dir(tmp_path):
    return write_run(tmp_path / "run")


def test_overrides_reproduce_the_measured_workload(run_dir):
    v = _values(make_overrides(load_run(run_dir)))
    ctx = (120 + 20 + 230 + 5 + 40 + 40) / 6  # new prompt + output tokens per call
    assert v["profile.segments_samples"] == "[2,2,1,1]"
    assert v["profile.gen_tokens_samples"] == "[20,10,30,5,40,40]"
    # harness start + gaps between calls + exit and evaluation, spread evenly over each execution's calls
    assert v["profile.tool_s_samples"] == "[2.45,2.45,0.75,0.75,2.0,2.0]"
    assert float(v["profile.context_tokens_per_segment"]) == round(ctx, 1)
    # three executions trained, at the run's mean of 1.5 calls per execution
    assert float(v["profile.train_token_factor"]) == round(PACKED_TOKENS / (3 * 1.5 * ctx), 4)
    assert float(v["profile.timeout_s"]) == 7.0
    assert float(v["profile.excluded_fraction"]) == 0.25
    assert (v["profile.groups_per_step"], v["profile.group_size"]) == ("1", "4")


def test_overrides_reproduce_the_measured_machine(run_dir):
    v = _values(make_overrides(load_run(run_dir)))
    assert float(v["preset.session_tok_s"]) == pytest.approx(10.0, rel=1e-3)
    assert float(v["preset.prefill_tok_s_per_node"]) == pytest.approx(100.0, rel=1e-3)
    assert v["preset.cell_gen_tok_s"] == "[20.0,20.0,20.0]"  # cell 2 shared; the others get its figure
    assert v["preset.cell_train_tok_s"] == "[300.0,400.0,350.0]"  # cell 2 never trained: the mean
    assert float(v["preset.optimizer_step_s"]) == 2.0  # publish + checkpoint
    assert (v["preset.num_nodes"], v["preset.num_cells"], v["preset.live_sessions_per_node"]) == ("3", "3", "4")
    assert {k: float(x) for k, x in v.items() if k.startswith("phase_s.")} == {
        "phase_s.stop_admission": 0.3,
        "phase_s.pull_weights": 1.0,
        "phase_s.load_weights": 0.6,
    }


def test_an_engines_capacity_is_its_best_loaded_rate_not_the_mean_over_loaded_time():
    # 2 calls together for 4 s at 20 tokens/s in all, then 4 together for 3 s at 60 tokens/s in all
    # (the mean over loaded time would be 260 / 7 = 37), then 3 together for 1 s: too short to count
    calls = (
        [_call("a", i, 1, 0.0, 4.0, 10, 0, 40) for i in range(2)]
        + [_call("b", i, 1, 10.0, 13.0, 10, 0, 45) for i in range(4)]
        + [_call("c", i, 1, 20.0, 21.0, 10, 0, 1000) for i in range(3)]
    )
    assert peak_rate(calls) == pytest.approx(60.0)
    assert peak_rate(calls, min_level_s=0.5) == pytest.approx(3000.0)
    assert peak_rate(calls[:1]) == 0.0  # never shared: no aggregate figure


def test_overrides_compose_into_a_sim_config_that_runs(run_dir):
    run = load_run(run_dir)
    sim = compose_sim(make_overrides(run), ["elastic", "colocate"])
    assert sim.preset.cell_train_tok_s == [300.0, 400.0, 350.0] and sim.profile.tool_s_samples[2] == 0.75
    assert sim.scheduler.min_dwell_s == SchedulerConfig().min_dwell_s and sim.num_steps == 1
    assert sim.preset.sessions_per_node(1.0) == 4  # the coordinator's sessions_per_cell, not the KV
    assert sim.scheduler.microstep_tokens == 8192  # how the live coordinator packs a group
    predicted = predict(sim)
    assert set(predicted) == {"elastic", "colocate"} and min(predicted.values()) > 0
    assert live_wall(run)["live_s"] == LAST_STEP_AT


@pytest.mark.parametrize(
    "breakage, message",
    [
        pytest.param(lambda d: shutil.rmtree(d / "records"), "no records", id="no-records-dir"),
        pytest.param(lambda d: [p.unlink() for p in (d / "records").iterdir()], "no model call", id="no-records"),
        pytest.param(lambda d: (d / "events.jsonl").unlink(), "no events.jsonl", id="no-events"),
    ],
)
def test_a_broken_run_dir_names_what_is_missing(run_dir, breakage, message):
    breakage(run_dir)
    with pytest.raises(CalibrationError, match=message):
        load_run(run_dir)


def test_an_unfinished_run_is_refused(tmp_path):
    with pytest.raises(CalibrationError, match="unfinished run: events.jsonl has 1 of num_steps=2"):
        load_run(write_run(tmp_path / "run", num_steps=2))


@pytest.mark.parametrize("cap, expected", [pytest.param(0, 1000, id="kv-bound"), pytest.param(8, 8, id="capped")])
def test_live_sessions_per_node_caps_what_the_kv_holds(cap, expected):
    preset = PresetConfig(kv_tokens_per_node=1e6, live_sessions_per_node=cap)
    assert preset.sessions_per_node(1000.0) == expected


@pytest.mark.parametrize(
    "turns, expected",
    [
        pytest.param([[0.1, 0.3, 0.5], [1.1, 1.2, 1.5]], 0.2, id="two-bursts"),
        pytest.param([[0.1, 0.3, 0.5], [1.1]], 0.2, id="a-lone-start-adds-no-gap"),
        pytest.param([[0.1], [1.1]], 0.0, id="no-turn-started-two"),
    ],
)
def test_the_coordinators_start_cost_is_the_spacing_of_starts_within_a_turn(run_dir, turns, expected):
    """Starts between two observations (one turn of the coordinator's loop) are start_s apart;
    the pause between turns is not a start's cost."""
    events = []
    for i, starts in enumerate(turns):
        events.append(ObservationEvent(t=T0 + i, queued=0, running=0, roles=[], sessions=[]))
        events += [
            ExecutionState(t=T0 + t, execution_id=f"e{t}", task_id="t", group_id="0", step=0, state="running")
            for t in starts
        ]
    run = replace(load_run(run_dir), events=events)
    assert measure_start_s(run) == pytest.approx(expected)


@pytest.mark.parametrize(
    "start, end, expected",
    [
        pytest.param(0.0, 1.0, 0.0, id="before-any-burst"),
        pytest.param(0.0, 3.0, 1.0, id="into-a-burst"),
        pytest.param(2.5, 7.0, 2.5, id="from-inside-one-across-the-next"),
        pytest.param(4.0, 5.0, 0.0, id="between-bursts"),
    ],
)
def test_the_wait_for_the_coordinators_starts_is_the_overlap_with_its_bursts(start, end, expected):
    """An execution that ended during a burst of starts is collected after it; the calibration
    leaves that wait out of its harness time (the simulator adds it)."""
    assert blocked_s([(2.0, 4.0), (6.0, 8.0)], start, end) == pytest.approx(expected)
