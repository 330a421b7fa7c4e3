"""gyre.metrics: events on disk, the fold, TensorBoard / W&B, progress, figures and gyre-report,
driven by the recorded fixture of a short elastic run (tests/unit/_metrics_run.py)."""

import io
import json
import logging
import random
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from _metrics_run import T0, TO_TRAIN_S, make_run_events

from gyre.coordinator.batching import GroupBatch
from gyre.coordinator.summary import RunEvents
from gyre.coordinator.training import StepRecord
from gyre.errors import ConfigError
from gyre.metrics.config import MetricsConfig
from gyre.metrics.events import (
    EventError,
    FailureEvent,
    HeldOutResult,
    MicroStepEvent,
    ModelCall,
    ObservationEvent,
    OptimizerStep,
    RoleSwitchEvent,
    RunStart,
    decode_event,
    encode_event,
)
from gyre.metrics.log import EventLog, EventTail, read_events
from gyre.metrics.monitor import RunMonitor
from gyre.metrics.progress import Progress, format_line, make_snapshot
from gyre.metrics.report import format_steps, summarize
from gyre.metrics.report import main as report_main
from gyre.metrics.sinks import TensorBoardSink, make_scalars
from gyre.metrics.state import Intervals, fold
from gyre.scheduler.cells import PHASE_SHARES, Phase
from gyre.trajectory.config import TrajectoryConfig
from gyre.trajectory.process import process_execution

QUIET = MetricsConfig(progress="off", figures=False, tensorboard=False)


@pytest.fixture(scope="module")
def run_events():
    return make_run_events()


def write_run(run_dir: Path, events) -> Path:
    with EventLog(run_dir) as log:
        for e in events:
            log.emit(e)
        assert log.num_dropped == 0
    return run_dir / "events.jsonl"


# --- events and the file ----------------------------------------------------------------------
def test_every_kind_round_trips_through_its_json_line(run_events):
    kinds = {}
    for e in run_events:
        kinds.setdefault(e.kind, e)
    assert len(kinds) == 12
    for e in kinds.values():
        assert decode_event(json.loads(encode_event(e))) == e


def test_numpy_values_encode_as_plain_numbers(run_events):
    import numpy as np

    step = next(e for e in run_events if isinstance(e, OptimizerStep))
    odd = replace(step, loss=np.float32(0.25), targets_naive=np.int64(7))
    back = decode_event(json.loads(encode_event(odd)))
    assert (back.loss, back.targets_naive) == (0.25, 7) and type(back.targets_naive) is int


@pytest.mark.parametrize(
    "obj, message",
    [
        ({"kind": "nope", "t": 1.0}, "unknown event kind"),
        ({"kind": "failure", "t": 1.0, "component": "x", "message": "y", "extra": 1}, "unknown fields"),
        ({"kind": "failure", "t": 1.0, "component": "x"}, "message"),
        (
            {
                "kind": "execution_state",
                "execution_id": "a",
                "task_id": "t",
                "group_id": "g",
                "step": 0,
                "state": "odd",
            },
            "execution state must be one of",
        ),
    ],
    ids=["unknown-kind", "unknown-field", "missing-field", "bad-state"],
)
def test_decode_rejects_lines_that_are_no_event(obj, message):
    with pytest.raises(EventError, match=message):
        decode_event(obj)


def test_two_writers_appending_to_one_file_never_interleave_lines(tmp_path):
    per_writer, payload = 1500, "x" * 5000  # lines longer than a pipe buffer

    def write(tag: str) -> None:
        with EventLog(tmp_path) as log:
            for i in range(per_writer):
                log.emit(FailureEvent(component=f"{tag}{i}", message=payload))

    threads = [threading.Thread(target=write, args=(tag,)) for tag in "ab"]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    events, stats = read_events(tmp_path / "events.jsonl")
    assert stats.invalid == [] and stats.num_torn == 0
    assert sorted(e.component for e in events) == sorted(f"{t}{i}" for t in "ab" for i in range(per_writer))


def test_file_cut_mid_line_reads_back_every_whole_line(tmp_path, run_events):
    path = write_run(tmp_path, run_events)
    data = path.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(data[: last_start + 25])  # a crash while the last line was being written
    events, stats = read_events(path)
    assert events == run_events[:-1]
    assert stats.num_torn == 1 and stats.invalid == []


def test_a_torn_line_inside_the_file_is_skipped_and_counted(tmp_path, run_events):
    path = write_run(tmp_path, run_events[:10])
    lines = path.read_bytes().splitlines(keepends=True)
    lines[4] = lines[4][:30] + b"\n"  # e.g. a short write on a full disk, then later lines
    path.write_bytes(b"".join(lines))
    events, stats = read_events(path)
    assert events == run_events[:4] + run_events[5:10]
    assert [n for n, _ in stats.invalid] == [5] and stats.num_torn == 0


def test_tail_returns_a_line_only_once_it_is_complete(tmp_path, run_events):
    path = tmp_path / "events.jsonl"
    line = encode_event(run_events[0])
    tail = EventTail(path)
    assert tail.read_new() == []  # no file yet
    path.write_bytes(line[:10])
    assert tail.read_new() == [] and tail.stats.num_torn == 1
    with open(path, "ab") as f:
        f.write(line[10:] + encode_event(run_events[1]))
    assert tail.read_new() == run_events[:2] and tail.stats.num_torn == 0


def test_full_disk_never_raises_out_of_emit_and_is_counted_and_logged_once(tmp_path, caplog):
    (tmp_path / "events.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    log = EventLog(tmp_path)
    with caplog.at_level(logging.WARNING, logger="gyre.metrics.log"):
        for i in range(5):
            log.emit(FailureEvent(component="c", message=str(i)))
    assert (log.num_written, log.num_dropped) == (0, 5)
    assert len([r for r in caplog.records if "dropping events" in r.message]) == 1
    log.close()


def test_unusable_run_directory_never_raises_out_of_emit(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    log = EventLog(not_a_dir)
    log.emit(FailureEvent(component="c", message="m"))
    log.emit(object())  # not even an event: counted, not raised
    assert log.num_dropped == 2
    log.close()


def test_shipped_yaml_sets_every_field_and_validates():
    from dataclasses import fields

    from omegaconf import OmegaConf

    from gyre.common import CONF_DIR

    yaml = OmegaConf.load(Path(CONF_DIR) / "metrics" / "default.yaml")
    assert set(yaml) == {f.name for f in fields(MetricsConfig)}
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(MetricsConfig), yaml))
    assert cfg == MetricsConfig()


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"progress": "fancy"}, "progress"),
        ({"progress_interval_s": 0}, "progress_interval_s"),
        ({"plots_interval_s": -1}, "plots_interval_s"),
        ({"wandb_mode": "cloud"}, "wandb_mode"),
    ],
    ids=["progress", "interval", "plots", "wandb-mode"],
)
def test_bad_config_names_the_key(kwargs, key):
    with pytest.raises(ConfigError) as e:
        MetricsConfig(**kwargs)
    assert e.value.key == key


# --- the fold and the summary -----------------------------------------------------------------
def test_fold_lays_each_switch_phase_end_to_end_in_the_cell_lane(run_events):
    state = fold(run_events)
    first = next(e for e in run_events if isinstance(e, RoleSwitchEvent))
    spans = [s for s in state.cells[2].spans if first.t_start <= s.t0 < first.t]
    assert [s.phase for s in spans] == ["hand_off_sessions", "release_engine_memory", "pull_weights", "join_step"]
    assert spans[0].t0 == first.t_start and all(a.t1 == pytest.approx(b.t0) for a, b in zip(spans, spans[1:]))
    assert {s.role for s in spans} == {"to_train"}
    for i in state.cells:
        assert sum(state.role_time_s(i).values()) == pytest.approx(state.duration_s)
        assert state.busy_s(i, "rollout") <= state.role_time_s(i).get("rollout", 0.0) + 1e-9


def test_a_cell_seen_lost_ends_its_lane_there(run_events):
    t_lost = run_events[-1].t + 5
    state = fold(
        [
            *run_events,
            ObservationEvent(t=t_lost, queued=0, running=0, roles=["train", "lost", "rollout"], sessions=[0, 0, 0]),
            ObservationEvent(
                t=t_lost + 20, queued=0, running=0, roles=["train", "lost", "rollout"], sessions=[0, 0, 0]
            ),
        ]
    )
    last = state.cells[1].spans_until(state.t_last)[-2:]
    assert [(s.role, s.t0, s.t1) for s in last] == [("rollout", last[0].t0, t_lost), ("lost", t_lost, t_lost + 20)]
    assert summarize(state)["cell_role_share"]["1"]["lost"] == pytest.approx(20 / state.duration_s, abs=1e-4)


@pytest.mark.parametrize(
    "added, window, expected",
    [
        ([(0, 2), (1, 3)], (0, 10), 3.0),
        ([(5, 6), (0, 1)], (0.5, 5.5), 1.0),
        ([(0, 10)], (2, 3), 1.0),
        ([(0, 1), (2, 3)], (1, 2), 0.0),
        ([], (0, 1), 0.0),
    ],
    ids=["overlap", "out-of-order", "inside", "gap", "empty"],
)
def test_intervals_measure_their_union(added, window, expected):
    iv = Intervals()
    for a, b in added:
        iv.add(a, b)
    assert iv.overlap_s(*window) == pytest.approx(expected)


def test_intervals_match_a_brute_force_union_past_compaction():
    rng, iv = random.Random(0), Intervals()
    covered = bytearray(10_010)  # half-second cells of [0, 5005)
    for _ in range(6000):  # past the compaction threshold, so merged and fresh items mix
        a, n = rng.randrange(10_000), rng.randrange(5)
        iv.add(a / 2, (a + n) / 2)
        covered[a : a + n] = b"\x01" * n
    for lo, hi in ((0, 10_010), (200, 260), (5001, 5002)):
        assert iv.overlap_s(lo / 2, hi / 2) == pytest.approx(sum(covered[lo:hi]) / 2)


def test_summary_of_the_fixture_run(run_events):
    s = summarize(fold(run_events))
    steps = [e for e in run_events if isinstance(e, OptimizerStep)]
    assert s["num_steps"] == 4 and s["num_steps_planned"] == 4 and s["mode"] == "elastic"
    assert s["executions"] == {"excluded": 3, "trained": 21} and s["exclusions"] == {"timed_out": 3}
    assert s["reward_first3"] == pytest.approx(sum(e.reward_mean for e in steps[:3]) / 3, abs=1e-4)
    assert s["reward_last3"] == pytest.approx(sum(e.reward_mean for e in steps[1:]) / 3, abs=1e-4)
    assert s["num_role_switches"] == 8
    assert s["switch_phase_s"]["pull_weights"] == pytest.approx(PHASE_SHARES[Phase.PULL_WEIGHTS] * TO_TRAIN_S, abs=1e-3)
    assert set(s["cell_role_share"]["0"]) == {"train"}  # the core never switches
    assert set(s["cell_role_share"]["2"]) == {"rollout", "to_train", "train", "to_rollout"}
    for shares in s["cell_role_share"].values():
        assert sum(shares.values()) == pytest.approx(1.0, abs=1e-3)
    naive = sum(e.targets_naive for e in steps)
    assert s["targets"]["naive"] == naive
    assert s["targets"]["saved_by_cap"] == pytest.approx(1 - sum(e.targets_capped for e in steps) / naive, abs=1e-4)
    assert s["num_calls"] == sum(isinstance(e, ModelCall) for e in run_events) and s["failures"] == {"engine e1": 1}
    # held-out rewards: means under the first and the last weights, an unscored execution left out,
    # each with its standard error (sample std / sqrt n), and the rise with the error of a difference
    assert (s["eval_reward_first"], s["eval_reward_last"]) == (0.3, pytest.approx(0.8))
    assert s["eval_reward_per_version"] == {0: 0.3, 4: pytest.approx(0.8)}
    assert s["eval_samples_per_version"] == {0: 2, 4: 3}
    se0, se4 = 0.1, 0.2 / 3**0.5  # stdev(0.2, 0.4) / sqrt 2, stdev(0.6, 1.0, 0.8) / sqrt 3
    assert (s["eval_reward_se_first"], s["eval_reward_se_last"]) == (
        pytest.approx(se0, abs=1e-4),
        pytest.approx(se4, abs=1e-4),
    )
    assert s["eval_rise"] == pytest.approx(0.5) and s["eval_rise_se"] == pytest.approx(
        (se0**2 + se4**2) ** 0.5, abs=1e-4
    )
    from gyre.metrics.report import format_summary
    from gyre.records.io import ReadStats

    assert "  held-out rise          0.500 +- 0.153\n" in format_summary("r", s, ReadStats())


def test_the_summary_gives_ranks_per_cell_each_ranks_train_busy_time_and_its_mean_switch_phase_times():
    from gyre.metrics.report import format_summary
    from gyre.records.io import ReadStats

    events = [RunStart(t=T0, mode="colocate", num_steps=1, num_cells=1, cell_ranks=2)]
    for k, (rank, seconds) in enumerate([(0, 2.0), (1, 3.0), (0, 1.5)]):
        events.append(MicroStepEvent(t=T0 + 10 + k, step=0, index=k, cell=0, rank=rank, tokens=100, seconds=seconds))
    for k, pull in enumerate(([0.5, 1.0], [1.5, 0.5], [2.5])):  # cell 1 switches to train 3 times, then of 1 rank
        rank_phases = {"release_engine_memory": [0.25] * len(pull), "pull_weights": pull}
        phases = {p: max(by_rank) for p, by_rank in rank_phases.items()}
        events.append(
            RoleSwitchEvent(
                t=T0 + 20 + 10 * k,
                cell=1,
                from_role="rollout",
                to_role="train",
                t_start=T0 + 18 + 10 * k,
                phases=phases,
                rank_phases=rank_phases,
            )
        )
    s = summarize(fold(events))
    assert s["cell_ranks"] == 2 and s["rank_train_busy_s"] == {"0": {"0": 3.5, "1": 3.0}}
    assert s["switch_phase_s"]["pull_weights"] == 1.667  # the cell's: its slowest rank's, 1.0, 1.5 then 2.5
    by_rank = {"release_engine_memory": [0.25, 0.25], "pull_weights": [1.5, 0.75]}  # rank 1 ran twice
    assert s["rank_switch_phase_s"] == {"1": by_rank}
    out = format_summary("r", s, ReadStats())
    assert "cell 0    train busy by rank  rank 0 3.5 s  rank 1 3.0 s" in out
    assert "cell 1    phases by rank (s)  release_engine_memory 0.25/0.25  pull_weights 1.50/0.75" in out


# --- live views -------------------------------------------------------------------------------
def test_tensorboard_scalars_are_readable_with_event_accumulator(tmp_path, run_events):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write_run(tmp_path, run_events)
    monitor = RunMonitor(tmp_path, replace(QUIET, tensorboard=True))
    monitor.update()
    summary = monitor.close()
    assert summary["view_errors"] == {} and summary["num_steps"] == 4
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "train/loss",
        "train/grad_norm",
        "train/kl_mean",
        "train/entropy_mean",
        "reward/mean",
        "tokens/targets_naive",
        "tokens/targets_capped",
        "tokens/targets_dedup",
        "tokens/saved_by_dedup",
        "cluster/waterlevel",
        "rollout/calls_per_s",
        "switch/pull_weights_s",
        "publish/seconds",
        "executions/trained",
    } <= tags
    steps = [e for e in run_events if isinstance(e, OptimizerStep)]
    assert [(s.step, s.value) for s in acc.Scalars("train/loss")] == [(e.step, pytest.approx(e.loss)) for e in steps]
    dedup = acc.Scalars("tokens/saved_by_dedup")
    assert [s.value for s in dedup] == [pytest.approx(1 - e.targets_dedup / e.targets_capped) for e in steps]
    waterlevel = acc.Scalars("cluster/waterlevel")  # sampled every sample_interval_s (10 s) of events
    observations = [e for e in run_events if isinstance(e, ObservationEvent)]
    assert len(waterlevel) == pytest.approx(len(observations) / 10, abs=1)
    assert all(b.step - a.step >= 10 for a, b in zip(waterlevel, waterlevel[1:]))
    assert {s.value for s in waterlevel} <= {e.waterlevel for e in observations} and max(
        s.value for s in waterlevel
    ) > 0


def test_a_raising_sink_never_stops_the_monitor_and_is_counted(tmp_path, run_events, monkeypatch, caplog):
    def broken(self, e, scalars):
        raise OSError("No space left on device")

    monkeypatch.setattr(TensorBoardSink, "write", broken)
    write_run(tmp_path, run_events[:50])
    monitor = RunMonitor(tmp_path, replace(QUIET, tensorboard=True))
    with caplog.at_level(logging.WARNING, logger="gyre.metrics.monitor"):
        monitor.update()
    summary = monitor.close()
    with_scalars = sum(isinstance(e, (RoleSwitchEvent, OptimizerStep)) for e in run_events[:50])
    with_scalars += sum(isinstance(e, HeldOutResult) and e.reward is not None for e in run_events[:50])
    observed = [e.t for e in run_events[:50] if isinstance(e, ObservationEvent)]
    with_scalars += len({int((t - observed[0]) // 10) for t in observed})  # one cluster sample per 10 s
    assert summary["view_errors"] == {"tensorboard": with_scalars} and with_scalars > 0
    assert len([r for r in caplog.records if "tensorboard failed" in r.message]) == 1


def test_an_event_with_a_value_the_fold_cannot_use_is_counted_and_skipped(tmp_path, run_events):
    path = write_run(tmp_path, run_events[:20])
    call = next(e for e in run_events if isinstance(e, ModelCall))
    bad = json.loads(encode_event(call)) | {"latency_s": "slow"}
    with open(path, "a") as f:
        f.write(json.dumps(bad) + "\n")
    write_run(tmp_path, run_events[20:])
    monitor = RunMonitor(tmp_path, QUIET)
    summary = monitor.close()
    assert summary["view_errors"] == {"fold": 1} and summary["num_steps"] == 4


def test_monitor_follows_events_other_processes_append_and_draws_at_the_end(tmp_path, run_events):
    monitor = RunMonitor(tmp_path, replace(QUIET, figures=True, plots_interval_s=0))
    half = len(run_events) // 2
    write_run(tmp_path, run_events[:half])
    monitor.update()
    assert monitor.state.num_calls == sum(isinstance(e, ModelCall) for e in run_events[:half])
    write_run(tmp_path, run_events[half:])  # another EventLog, as the proxy's would be
    assert not (tmp_path / "timeline.png").exists()  # plots_interval_s=0: only at the end
    summary = monitor.close()
    assert summary["num_calls"] == sum(isinstance(e, ModelCall) for e in run_events) and summary["num_steps"] == 4
    assert {p.name for p in tmp_path.glob("*.png")} == {"timeline.png", "reward.png", "tokens.png", "utilisation.png"}


def test_wandb_offline_run_logs_the_scalars_and_the_figures(tmp_path, run_events):
    pytest.importorskip("wandb")
    write_run(tmp_path, run_events)
    monitor = RunMonitor(tmp_path, replace(QUIET, wandb=True, wandb_mode="offline", figures=True, plots_interval_s=0))
    assert monitor.close()["view_errors"] == {}
    (run_dir,) = tmp_path.glob("wandb/offline-run-*")
    (run_file,) = run_dir.glob("run-*.wandb")
    data = run_file.read_bytes()
    assert b"train/loss" in data and b"tokens/saved_by_dedup" in data and b"cluster/waterlevel" in data
    # The figures are the run's last records, and wandb's core now and then leaves an offline run's last records
    # out of the transaction log (CI, 2026-12-07; verl#494 reports the same); the SDK copies each logged image
    # into the run's media folder as it is logged, under its key, so that is where they are checked.
    figures = ("timeline", "reward", "tokens", "utilisation")
    logged = {p.name.split("_")[0] for p in run_dir.glob("files/media/images/figures/*.png")}
    assert logged == set(figures)


def test_plain_progress_lines_come_at_each_step_and_otherwise_at_most_every_interval(run_events):
    out = io.StringIO()
    progress = Progress(MetricsConfig(progress="auto", progress_interval_s=30), stream=out)
    assert progress.mode == "plain"  # not a terminal
    state = fold([])
    for e in run_events:
        state.add(e)
        progress.update(state, now=e.t)
    progress.close(state, now=run_events[-1].t)
    lines = out.getvalue().splitlines()
    steps = [e.t for e in run_events if isinstance(e, OptimizerStep)]
    span = run_events[-1].t - run_events[0].t
    assert len(steps) < len(lines) <= len(steps) + span / 30 + 2  # + the closing line
    assert lines[-1].startswith("step 4/4 |") and "cells 0:T 1:R 2:T>R" in lines[-1] and "excluded 3" in lines[-1]


def test_live_progress_renders_the_table(run_events):
    out = io.StringIO()
    progress = Progress(MetricsConfig(progress="live"), stream=out)
    state = fold(run_events)
    progress.update(state, now=run_events[-1].t)
    progress.close(state, now=run_events[-1].t)
    text = out.getvalue()
    assert "gyre run" in text and "4/4" in text and "0:T 1:R 2:T>R" in text and "3   failures 1" in text


def test_progress_snapshot_eta_from_mean_step_time(run_events):
    steps = [e for e in run_events if isinstance(e, OptimizerStep)]
    state = fold([e for e in run_events if e.t <= steps[1].t])
    snap = make_snapshot(state, now=steps[1].t)
    per_step = (steps[1].t - run_events[0].t) / 2
    assert snap.steps_done == 2 and snap.eta_s == pytest.approx(2 * per_step)
    assert "ETA" in format_line(snap) and snap.reward_mean == steps[1].reward_mean


# --- figures and gyre-report ------------------------------------------------------------------
def test_gyre_report_rebuilds_figures_and_compares_runs(tmp_path, run_events, capsys):
    elastic, colocate = tmp_path / "elastic", tmp_path / "run2"
    write_run(elastic, run_events)
    write_run(colocate, make_run_events(seed=1, mode="colocate"))
    with open(colocate / "events.jsonl", "ab") as f:
        f.write(b'{"kind":"model_call","t":17')  # crashed mid-write
    assert report_main([str(elastic), str(colocate), "--out", str(tmp_path), "--json"]) == 0
    out = capsys.readouterr().out
    assert "== elastic\n" in out and "== colocate (run2)\n" in out and "1 torn last line" in out
    assert "targets naive" in out and "saved by dedup" in out
    for d in (elastic, colocate):
        figures = sorted(d.glob("*.png"))
        assert [p.name for p in figures] == ["reward.png", "timeline.png", "tokens.png", "utilisation.png"]
        assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000 for p in figures)
    assert (tmp_path / "compare.png").stat().st_size > 10_000
    assert (tmp_path / "compare_timeline.png").stat().st_size > 10_000
    runs = json.loads(out.strip().splitlines()[-1])["runs"]
    assert runs["elastic"]["num_role_switches"] == 8 and runs["colocate (run2)"]["mode"] == "colocate"
    assert runs["elastic"]["switch_s"] == {"to_train": pytest.approx(TO_TRAIN_S), "to_rollout": pytest.approx(3.46)}


def test_gyre_report_on_a_missing_run_says_so(tmp_path, capsys):
    assert report_main([str(tmp_path)]) == 2
    assert "events.jsonl: no such file" in capsys.readouterr().err


def test_each_optimizer_step_reports_the_targets_the_path_cap_and_dedup_saved(tmp_path):
    """From the trajectory processor's counts of real paths, through the coordinator's event, to the per-step views."""
    from test_trajectory_tree import hand_built  # 8 paths, a shared prefix: K=5 -> 156/144/136, K=1 -> 156/24/24

    groups = []
    for max_paths, eid in ((5, "a"), (1, "b")):
        counts = process_execution(hand_built(eid), TrajectoryConfig(max_paths=max_paths)).counts
        groups.append((None, GroupBatch(micro_batches=[], rewards={eid: 0.5}, counts=counts)))
    run = RunEvents(tmp_path, SimpleNamespace(metrics=QUIET, num_steps=1, scheduler=SimpleNamespace(mode="elastic")))
    run.step(StepRecord(step=0, groups=groups, metrics={"loss": 0.1, "grad_norm": 1.0}, seconds=2.0))
    run.close()
    (step,), _ = read_events(tmp_path / "events.jsonl")
    assert (step.targets_naive, step.targets_capped, step.targets_dedup) == (312, 168, 160)
    assert step.seq_tokens_naive > step.seq_tokens_capped >= step.seq_tokens_packed > 0
    state = fold([step])
    values = make_scalars(step, state).values
    assert values["tokens/saved_by_cap"] == pytest.approx(1 - 168 / 312)
    assert values["tokens/saved_by_dedup"] == pytest.approx(1 - 160 / 168)
    assert format_steps(state).splitlines()[1].split()[6:10] == ["312", "168", "160", "49%"]
    assert summarize(state)["targets"] == {
        "naive": 312,
        "capped": 168,
        "dedup": 160,
        "saved_by_cap": round(1 - 168 / 312, 4),
        "saved_by_dedup": round(1 - 160 / 168, 4),
    }


def test_figures_are_redrawn_during_the_run_at_most_every_plots_interval(tmp_path, run_events, monkeypatch):
    drawn = []  # (now, optimizer steps folded so far) at each redraw
    monkeypatch.setattr(
        "gyre.metrics.monitor.write_figures", lambda state, out_dir, name: drawn.append((now, len(state.steps)))
    )
    monitor = RunMonitor(tmp_path, replace(QUIET, figures=True, plots_interval_s=100))
    steps = [e for e in run_events if isinstance(e, OptimizerStep)]
    written = 0
    for now in (0, 50, 100, 150, 230):
        upto = len([e for e in run_events if e.t <= T0 + now])
        write_run(tmp_path, run_events[written:upto])
        written = upto
        monitor.update(now=now)
    write_run(tmp_path, run_events[written:])
    now = 240
    monitor.close(now=now)
    assert [t for t, _ in drawn] == [100, 230, 240]  # an interval in, not on every update; always at the end
    assert [n for _, n in drawn] == [sum(e.t <= T0 + 100 for e in steps), sum(e.t <= T0 + 230 for e in steps), 4]
