"""Calibrate the simulator to a finished live run: gyre-sim overrides measured from its run directory.

    run dir ─ load_run ─> LiveRun (config, records, ledger, events)      (the only I/O)
      measure_workload ─> profile.*   (calls per execution, tokens per call, gaps between calls)
      measure_start_s  ─> profile.start_s (the coordinator's seconds per execution it starts)
      measure_engines  ─> preset.*    (session and aggregate decode, prefill per cell)
      measure_training ─> preset.*    (training tokens/s per cell, the core's step overhead)
      measure_phases   ─> +phase_s.*  (role-switch phases as the cell leaders timed them)
      config           ─> scheduler.* and the cells, sessions and KV the run was given
    make_overrides ─> ["profile.tool_s_samples=[...]", ...] ─ predict ─> simulated s per mode

Every workload and machine figure is measured from the run's files; only what the run was told
to do (groups, cells, sessions per cell, scheduler keys) comes from its resolved config. What the
simulator does not model is left out of the live time it is compared with (`live_wall`): start-up
(cells starting, warm start) before the first execution runs, and the final checkpoint after the
last optimizer step.

Run: PYTHONPATH=. python -m gyre.sim.calibrate RUN_DIR [--modes elastic,async,colocate]
"""

import argparse
import bisect
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from gyre.common import jsonio
from gyre.common.run_paths import RunPaths
from gyre.coordinator.ledger import LedgerView, read_ledger
from gyre.errors import ConfigError, GyreError
from gyre.metrics.events import Event
from gyre.metrics.log import read_events
from gyre.records.io import read_records
from gyre.records.record import CallRecord
from gyre.scheduler.cells import Phase
from gyre.scheduler.config import MODES

LOW_CONCURRENCY = 1.5
"""A call that shared its engine with fewer than this many calls on average (itself included)
measures one session's speed: the engine's batch did not slow it."""
PEAK_LEVEL_S = 2.0
"""Seconds a concurrency level must be held in all before its rate counts towards an engine's
capacity (`peak_rate`): shorter ones are a call or two, noise."""


class CalibrationError(GyreError):
    """A run directory the simulator cannot be calibrated to (missing files, an unfinished run)."""


@dataclass(frozen=True)
class LiveRun:
    """What a finished gyre-train run left in its directory."""

    run_dir: Path
    config: dict
    """The resolved Hydra config (.hydra/config.yaml)."""
    records: dict[str, list[CallRecord]]
    """Execution id -> its model calls, in start order."""
    ledger: LedgerView
    events: list[Event]
    config_written_at: float
    """When Hydra wrote the config (unix s): the process's start, before the cells were built."""


def load_run(run_dir: str | Path) -> LiveRun:
    """Read a finished run directory.

    Raises:
        CalibrationError: a file the calibration needs is missing or empty, or the run did not
            reach its last optimizer step (still running, or it failed).
    """
    d, paths = Path(run_dir), RunPaths(run_dir)
    cfg_path = paths.config
    for path in (cfg_path, paths.ledger, paths.events, paths.records):
        if not path.exists():
            raise CalibrationError(f"{d}: no {path.relative_to(d)} (is it a gyre-train run directory?)")
    records = {}
    for path in sorted(paths.records.glob("*.jsonl")):
        calls, _ = read_records(path)
        if calls:
            records[path.stem] = sorted(calls, key=lambda r: r.started_at)
    if not records:
        raise CalibrationError(f"{d}: records/ holds no model call; the run never served a rollout")
    events, _ = read_events(paths.events)
    config = OmegaConf.to_container(OmegaConf.load(cfg_path))
    run = LiveRun(d, config, records, read_ledger(paths.ledger), events, cfg_path.stat().st_mtime)
    start = next((e for e in events if e.kind == "run_start"), None)
    if start is None or start.start_step:
        raise CalibrationError(f"{d}: events.jsonl has no run_start from step 0 (a resumed run is not modelled)")
    steps = {e.step for e in _of(run, "optimizer_step")}
    if len(steps) < config["num_steps"]:
        raise CalibrationError(
            f"{d}: unfinished run: events.jsonl has {len(steps)} of num_steps={config['num_steps']} optimizer steps"
        )
    return run


def _of(run: LiveRun, kind: str) -> list:
    return [e for e in run.events if e.kind == kind]


def _executions(run: LiveRun) -> list[str]:
    """Executions whose rollout ended (finished, timed out or excluded)."""
    return [e for e in run.ledger.history if run.ledger.outcome(e) is not None]


def new_prompt_tokens(call: CallRecord) -> int:
    """Prompt tokens the engine had to prefill: the input beyond what its prefix cache held."""
    return len(call.input_ids) - int(call.hints.get("cached_tokens", 0))


def measure_workload(run: LiveRun) -> dict:
    """The profile: calls per execution, output tokens per call, the time between calls, context
    growth per call, trained tokens per context token, the time budget and the excluded share.

    An execution's time outside model calls (harness start before its first call, tool calls
    between calls, the harness's exit and the evaluation after its last) is spread evenly over
    its calls, one sample per call: the simulator draws each segment's tool time on its own, and
    a start-up drawn as one sample among the gaps would land in a random number of segments of
    an execution (0, 1 or several) instead of once. An execution that ended while the coordinator
    was starting others is collected after them; that wait is left out (the simulator adds it,
    profile.start_s).
    """
    execs = _executions(run)
    calls_of = {e: run.records.get(e, []) for e in execs}
    with_calls = [e for e in execs if calls_of[e]]
    if not with_calls:
        raise CalibrationError(f"{run.run_dir}: no execution made a model call")
    start_s = measure_start_s(run)
    busy = [(b[0], b[0] + len(b) * start_s) for b in _turn_starts(run)]  # the coordinator's bursts of starts
    segments, gen, tool = [], [], []
    for e in with_calls:
        calls, hist = calls_of[e], run.ledger.history[e]
        started = next(x.t for x in hist if x.state == "running")
        ended = run.ledger.outcome(e).t
        gaps = [max(0.0, b.started_at - a.finished_at) for a, b in zip(calls, calls[1:])]
        # an ended harness waits for the coordinator's starts before it is collected: the
        # simulator adds that wait itself (profile.start_s)
        ended -= blocked_s(busy, calls[-1].finished_at, ended)
        outside = sum(gaps) + max(0.0, calls[0].started_at - started) + max(0.0, ended - calls[-1].finished_at)
        tool += [outside / len(calls)] * len(calls)
        segments.append(len(calls))
        gen += [len(c.output_ids) for c in calls]
    all_calls = [c for e in with_calls for c in calls_of[e]]
    ctx = float(np.mean([new_prompt_tokens(c) + len(c.output_ids) for c in all_calls]))
    trained = [e for e in with_calls if run.ledger.trained_step(e) is not None]
    trained_tokens = sum(e.seq_tokens_packed for e in _of(run, "optimizer_step"))
    if not trained or not trained_tokens:
        raise CalibrationError(f"{run.run_dir}: no execution was trained (ledger) or no token (optimizer_step events)")
    timed_out = [run.ledger.outcome(e).duration_s for e in execs if run.ledger.outcome(e).state == "timed_out"]
    spans = [
        run.ledger.outcome(e).t - next(x.t for x in run.ledger.history[e] if x.state == "running") for e in with_calls
    ]
    return {
        "groups_per_step": run.config["coordinator"]["groups_per_step"],
        "group_size": run.config["coordinator"]["group_size"],
        "segments_samples": segments,
        "segments_sigma": 0.0,  # the samples carry the spread between tasks and executions
        "exec_sigma": 0.0,
        "max_segments": max(segments),
        "gen_tokens_samples": gen,
        "tool_s_samples": [round(t, 3) for t in tool],
        "context_tokens_per_segment": round(ctx, 1),
        "max_context_tokens": int(np.ceil(max(segments) * ctx)),  # the harness's compaction is in ctx
        # the simulator excludes executions at random, so the factor keeps the run's trained tokens
        # per step at its mean calls per execution (live, longer executions were trained more often)
        "train_token_factor": round(trained_tokens / (len(trained) * float(np.mean(segments)) * ctx), 4),
        # the live cut-off is the budget plus the coordinator's poll; none cut off: the budget never bound
        "timeout_s": round(float(np.median(timed_out)) if timed_out else max(spans), 2),
        "excluded_fraction": round(1 - len(trained) / len(execs), 4),
    }


def _turn_starts(run: LiveRun) -> list[list[float]]:
    """When each turn of the coordinator's loop (between two of its observations) started its
    executions, one after another."""
    ticks = sorted(e.t for e in _of(run, "observation"))
    turns = defaultdict(list)
    for e in _of(run, "execution_state"):
        if e.state == "running":
            turns[bisect.bisect(ticks, e.t)].append(e.t)
    return [sorted(b) for _, b in sorted(turns.items())]


def measure_start_s(run: LiveRun) -> float:
    """Seconds the coordinator spends starting one execution (proxy registration, sandbox,
    harness): within a turn of its loop consecutive starts are that far apart. Total span over
    total gaps, so the long bursts that matter weigh most; 0 when no turn started two."""
    turns = _turn_starts(run)
    gaps = sum(len(b) - 1 for b in turns)
    return round(sum(b[-1] - b[0] for b in turns) / gaps, 4) if gaps else 0.0


def blocked_s(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] inside the (disjoint) `intervals`."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in intervals)


def _concurrency(calls: list[CallRecord]) -> np.ndarray:
    """Mean number of calls in flight on the same engine during each call, itself included: the
    integral of calls in flight over its span, from one sweep over every start and end."""
    st = np.array([c.started_at for c in calls])
    fi = np.array([c.finished_at for c in calls])
    t = np.concatenate([st, fi])
    order = np.argsort(t, kind="stable")
    t = t[order]
    in_flight = np.cumsum(np.concatenate([np.ones(len(st)), -np.ones(len(fi))])[order])
    area = np.concatenate([[0.0], np.cumsum(in_flight[:-1] * np.diff(t))])
    return (np.interp(fi, t, area) - np.interp(st, t, area)) / np.maximum(fi - st, 1e-9)


def peak_rate(calls: list[CallRecord], min_level_s: float = PEAK_LEVEL_S) -> float:
    """Output tokens/s an engine delivered at its best concurrency level of two or more calls held
    for `min_level_s` in all (each call's tokens spread evenly over its span): its aggregate
    decode capacity as far as the run loaded it, the cap the simulator's engine puts on the
    sum of its sessions' speeds. Not the mean over all loaded time, which 2-3 calls dominate:
    a batched engine is far from its cap there (the builtin engine delivered ~90 tokens/s at
    2-3 calls and ~570 at 16, rising all the way), so every session would run too slow in the
    simulator once 10 or more share a cell. 0 when no such level was held that long."""
    changes = []
    for c in calls:
        rate = len(c.output_ids) / max(c.finished_at - c.started_at, 1e-9)
        changes += [(c.started_at, 1, rate), (c.finished_at, -1, -rate)]
    changes.sort(key=lambda x: (x[0], x[1]))  # ends before starts at the same instant
    in_flight, rate, prev = 0, 0.0, None
    tokens, seconds = defaultdict(float), defaultdict(float)
    for t, step, dr in changes:
        if in_flight >= 2:
            seconds[in_flight] += t - prev
            tokens[in_flight] += (t - prev) * rate
        in_flight, rate, prev = in_flight + step, rate + dr, t
    return max((tokens[n] / s for n, s in seconds.items() if s >= min_level_s), default=0.0)


def measure_engines(run: LiveRun, num_cells: int) -> dict:
    """Decode and prefill per cell from the proxy's records.

    One session's decode speed and the prefill throughput come from calls that had their engine
    to themselves: duration = output / session speed + new prompt / prefill speed (least squares
    over all cells). Each cell's aggregate decode is the best rate it delivered while calls
    shared it (`peak_rate`); a cell that never served (the core, in elastic) gets the mean of
    those that did.
    """
    by_cell = defaultdict(list)
    for calls in run.records.values():
        for c in calls:
            by_cell[int(c.cell_id)].append(c)
    alone = [c for calls in by_cell.values() for c, k in zip(calls, _concurrency(calls)) if k < LOW_CONCURRENCY]
    if len(alone) < 2:
        raise CalibrationError(
            f"{run.run_dir}: fewer than 2 model calls ran alone on an engine; one session's speed cannot be measured"
        )
    a = np.array([[len(c.output_ids), new_prompt_tokens(c)] for c in alone], dtype=float)
    dur = np.array([c.finished_at - c.started_at for c in alone])
    (s_per_tok, p_per_tok), *_ = np.linalg.lstsq(a, dur, rcond=None)
    if s_per_tok <= 0:
        raise CalibrationError(f"{run.run_dir}: calls alone on an engine give no positive decode time per token")
    out = {"session_tok_s": round(1 / s_per_tok, 2)}
    if p_per_tok > 0:  # else prefill hid in the noise: the simulator's derivation stands
        out["prefill_tok_s_per_node"] = round(1 / p_per_tok / run.config["cluster"]["cell_nodes"], 1)
    rates = {i: peak_rate(calls) for i, calls in by_cell.items()}
    measured = [r for r in rates.values() if r > 0] or [out["session_tok_s"]]
    out["cell_gen_tok_s"] = [round(rates.get(i) or float(np.mean(measured)), 1) for i in range(num_cells)]
    return out


def measure_training(run: LiveRun, num_cells: int) -> dict:
    """Training tokens/s per cell from its micro-steps (a cell that never trained gets the mean of
    those that did), and the core's serial work per step beyond them: publishing to the serving
    engines and the checkpoint, which holds the core before it can take the next step's
    micro-batches (means, so the run's total is kept)."""
    tokens, seconds = defaultdict(float), defaultdict(float)
    for m in _of(run, "micro_step"):
        tokens[m.cell] += m.tokens
        seconds[m.cell] += m.seconds
    rates = {c: tokens[c] / seconds[c] for c in tokens if seconds[c] > 0}
    if not rates:
        raise CalibrationError(f"{run.run_dir}: events.jsonl has no timed micro_step event")
    mean = float(np.mean(list(rates.values())))
    publish = [e.seconds for e in _of(run, "weight_publish")]
    ckpt = [e.seconds for e in _of(run, "checkpoint")]
    if not publish or not ckpt:
        raise CalibrationError(f"{run.run_dir}: events.jsonl has no weight_publish or no checkpoint event")
    return {
        "cell_train_tok_s": [round(rates.get(i, mean), 1) for i in range(num_cells)],
        "optimizer_step_s": round(float(np.mean(publish) + np.mean(ckpt)), 3),
    }


def measure_phases(run: LiveRun) -> dict[str, float]:
    """Mean seconds of each role-switch phase (the simulator times finish_microstep itself)."""
    by = defaultdict(list)
    for e in _of(run, "role_switch"):
        for name, s in e.phases.items():
            by[name].append(s)
    return {k: round(statistics.fmean(v), 4) for k, v in sorted(by.items()) if k != Phase.FINISH_MICROSTEP.value}


def live_wall(run: LiveRun) -> dict:
    """The live run's time the simulator models (first execution running to last optimizer step),
    and what it leaves out: start-up before it and the final checkpoint after."""
    first = min(x.t for h in run.ledger.history.values() for x in h if x.state == "running")
    last = max(e.t for e in _of(run, "optimizer_step"))
    end = max(e.t for e in run.events)
    return {
        "live_s": round(last - first, 1),
        "startup_s": round(first - run.config_written_at, 1),
        "after_last_step_s": round(end - last, 1),
    }


def _fmt(value) -> str:
    """A value in Hydra's override syntax."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    if value is None:
        return "null"
    return str(value)


def make_overrides(run: LiveRun) -> list[str]:
    """gyre-sim overrides that model `run`: its workload, its cells and its scheduler config.

    Cells become the simulator's nodes one to one (cell_nodes per cell); the coordinator's
    sessions_per_cell bounds live sessions and the engine's batch; the engine's prefix cache is
    the KV a node holds; the builtin engine has no host tier (KV moves by migration), so none. The
    live coordinator packs a group into as few near-equal micro-batches of at most
    max_micro_batch_tokens as fit (gyre.trajectory.pack), which the simulator's
    `microstep_tokens` models as equal parts of at most that many tokens (whole paths can need a
    row more; a cell of several data-parallel replicas gets a row per replica at least, which the
    simulator does not model).
    """
    cfg = run.config
    cells, nodes = cfg["cluster"]["num_cells"], cfg["cluster"]["cell_nodes"]
    per_node = cfg["coordinator"]["sessions_per_cell"] // nodes
    preset = {
        "name": "live",
        "num_nodes": cells * nodes,
        "num_cells": cells,
        "max_sessions_per_node": per_node,
        "live_sessions_per_node": per_node,
        "kv_tokens_per_node": cfg["engine"]["prefix_cache_tokens"] / nodes,
        "host_kv_tokens_per_node": 0,
        **measure_engines(run, cells),
        **measure_training(run, cells),
    }
    profile = {
        "name": "live",
        **measure_workload(run),
        "start_s": measure_start_s(run),
        "start_budget_s": cfg["coordinator"].get("start_budget_s", 0.0),  # runs before it: the whole burst
    }
    scheduler = {k: v for k, v in cfg["scheduler"].items() if k != "mode"}
    scheduler["microstep_tokens"] = cfg["coordinator"]["max_micro_batch_tokens"]
    return (
        [f"profile.{k}={_fmt(v)}" for k, v in profile.items()]
        + [f"preset.{k}={_fmt(v)}" for k, v in preset.items()]
        + [f"scheduler.{k}={_fmt(v)}" for k, v in scheduler.items()]
        + [f"+phase_s.{k}={v}" for k, v in measure_phases(run).items()]
        + [
            f"num_steps={cfg['num_steps']}",
            f"seed={cfg['seed']}",
            f"tick_s={cfg['coordinator']['tick_s']}",
            "plot=",
            "json=true",
        ]
    )


def compose_sim(overrides: list[str], modes: list[str]):
    """The typed SimConfig gyre-sim composes from conf/sim.yaml with `overrides` and `modes`.

    Raises:
        ConfigError: an override the simulator's config rejects, naming its key.
    """
    import hydra

    from gyre.common import CONF_DIR
    from gyre.config import validate
    from gyre.sim.config import SimConfig

    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        overrides = [*overrides, f"modes=[{','.join(modes)}]"]
        return validate(hydra.compose(config_name="sim", overrides=overrides), SimConfig)


def predict(sim) -> dict[str, float]:
    """Simulated seconds from the first admission to the last optimizer step, per mode of `sim`."""
    from gyre.sim.runner import run_modes

    return {r.mode: round(r.total_s, 1) for r in run_modes(sim)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Predict a live run's wall time per mode with the simulator "
        "calibrated to it; last line: {mode: predicted_wall_s}."
    )
    parser.add_argument("run_dir")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated (default: all)")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        sys.exit(f"unknown mode(s) {', '.join(unknown)}; valid: {', '.join(MODES)}")
    try:
        run = load_run(args.run_dir)
        overrides = make_overrides(run)
        sim = compose_sim(overrides, modes)
    except (CalibrationError, ConfigError) as e:
        sys.exit(f"gyre.sim.calibrate: {e}")
    live = live_wall(run)
    print("overrides:\n  " + "\n  ".join(o if len(o) < 160 else o[:150] + " ...]" for o in overrides))
    predicted = predict(sim)
    mode = run.config["scheduler"]["mode"]
    print(
        f"live {mode}: {live['live_s']} s from the first execution to the last optimizer step "
        f"(not simulated: {live['startup_s']} s start-up before, {live['after_last_step_s']} s after)"
    )
    for m, s in predicted.items():
        ratio = f"  {s / live['live_s']:.3f}x the live {mode} run" if m == mode else ""
        print(f"predicted {m:<9} {s:8.1f} s{ratio}")
    print(jsonio.dumps(predicted))


if __name__ == "__main__":
    main()
