"""`gyre-report RUN_DIR [RUN_DIR ...]`: a run's figures and summary from its events.jsonl alone.

Works on finished, crashed (a torn last line is skipped) and still-running runs. With two or more
run directories it also prints them side by side and draws compare.png (reward and steps against
wall time) and compare_timeline.png (every run's cells on one time scale), e.g. one run per mode.
`summarize(state)` is the same summary as a dict: the coordinator returns it at the end of a run.
"""

import argparse
import math
import sys
from pathlib import Path
from statistics import fmean

from gyre.common import jsonio
from gyre.common.run_paths import RunPaths
from gyre.metrics.config import MetricsConfig
from gyre.metrics.log import EventTail
from gyre.metrics.plots import draw_timelines, plot_compare, timeline_panel, utilisation, write_figures
from gyre.metrics.progress import format_duration
from gyre.metrics.state import RunState, mean_se
from gyre.records.io import ReadStats


def load_run(run_dir: str | Path, cfg: MetricsConfig | None = None) -> tuple[RunState, ReadStats]:
    """Fold a run directory's events file (streamed, so a long run's file need not fit in memory)."""
    cfg = cfg or MetricsConfig()
    tail = EventTail(RunPaths(run_dir).events)
    state = RunState(rate_window_s=cfg.rate_window_s)
    for e in tail.read_all():
        state.add(e)
    return state, tail.stats


def run_name(state: RunState, run_dir: str | Path) -> str:
    """The run's label: its RunStart name, else its mode and directory."""
    if state.run and state.run.name:
        return state.run.name
    dir_name = Path(run_dir).resolve().name
    if state.run is None or state.run.mode == dir_name:
        return dir_name
    return f"{state.run.mode} ({dir_name})"


def summarize(state: RunState) -> dict:
    """The run's headline figures (JSON-ready); rewards are the trained batches' means."""
    steps = [state.steps[k] for k in sorted(state.steps)]
    rewards = [s.reward_mean for s in steps]
    naive, capped, dedup = (sum(getattr(s, f"targets_{k}") for s in steps) for k in ("naive", "capped", "dedup"))
    shares = {}
    for i in sorted(state.cells):
        time_s = state.role_time_s(i)
        shares[str(i)] = {r: round(t / max(state.duration_s, 1e-9), 4) for r, t in time_s.items()}
    return {
        "mode": state.run.mode if state.run else None,
        "duration_s": round(state.duration_s, 3),
        "num_steps": len(steps),
        "num_steps_planned": state.run.num_steps if state.run else None,
        "executions": dict(sorted(state.outcomes().items())),
        "executions_continued": len(state.continued),
        "executions_rerun": state.num_rerun,
        "tokens_kept_by_continue": state.tokens_kept,
        "exclusions": dict(sorted(state.exclusions.items())),
        "reward_first3": round(fmean(rewards[:3]), 4) if rewards else None,
        "reward_last3": round(fmean(rewards[-3:]), 4) if rewards else None,
        "reward_per_step": [round(r, 4) for r in rewards],
        **held_out_summary(state.held_out),
        "num_role_switches": state.num_switches,
        "switch_s": {k: round(fmean(v), 3) for k, v in state.switch_s.items()},
        "switch_phase_s": {p: round(fmean(v), 3) for p, v in state.phase_s.items()},
        "cell_ranks": state.run.cell_ranks if state.run else None,
        "cell_role_share": shares,
        "rank_train_busy_s": {
            str(i): {str(r): round(v, 3) for r, v in sorted(lane.rank_train_s.items())}
            for i, lane in sorted(state.cells.items())
            if lane.rank_train_s
        },
        "rank_switch_phase_s": {
            str(i): {p: _mean_by_rank(runs) for p, runs in lane.rank_phase_s.items()}
            for i, lane in sorted(state.cells.items())
            if any(len(runs[0]) > 1 for runs in lane.rank_phase_s.values())
        },
        "cell_utilisation": {
            str(i): {k: round(v, 4) for k, v in parts.items()} for i, parts in utilisation(state).items()
        },
        "num_calls": state.num_calls,
        "calls_per_s": round(state.num_calls / state.duration_s, 3) if state.duration_s else 0.0,
        "prompt_tokens": state.prompt_tokens,
        "output_tokens": state.output_tokens,
        "cached_tokens": state.cached_tokens,
        "targets": {
            "naive": naive,
            "capped": capped,
            "dedup": dedup,
            "saved_by_cap": round(1 - capped / naive, 4) if naive else 0.0,
            "saved_by_dedup": round(1 - dedup / capped, 4) if capped else 0.0,
        },
        "num_micro_steps": state.num_micro_steps,
        "weight_publish_s": round(fmean(p.seconds for p in state.publishes), 3) if state.publishes else None,
        "num_checkpoints": len(state.checkpoints),
        "failures": dict(sorted(state.failures.items())),
    }


def _mean_by_rank(runs: list[list[float]]) -> list[float]:
    """Each rank's mean over the times it ran (a resumed run may have other ranks per cell)."""
    ranks = range(max(map(len, runs)))
    return [round(fmean(run[r] for run in runs if r < len(run)), 3) for r in ranks]


def held_out_summary(held_out: dict[int, list[float]]) -> dict:
    """The held-out tasks' mean reward at each weight version they were rolled out under, with its
    standard error; the first and the last version's, and the rise between them with the standard
    error of that difference (the two are independent samples of rollouts)."""
    stats = {v: mean_se(r) for v, r in sorted(held_out.items()) if r}
    first = stats[min(stats)] if stats else (None, None)
    last = stats[max(stats)] if len(stats) > 1 else (None, None)
    rise = last[0] - first[0] if last[0] is not None else None
    rise_se = math.hypot(first[1], last[1]) if None not in (first[1], last[1]) else None
    return {
        "eval_reward_first": _round(first[0]),
        "eval_reward_se_first": _round(first[1]),
        "eval_reward_last": _round(last[0]),
        "eval_reward_se_last": _round(last[1]),
        "eval_rise": _round(rise),
        "eval_rise_se": _round(rise_se),
        "eval_reward_per_version": {v: _round(m) for v, (m, _) in stats.items()},
        "eval_se_per_version": {v: _round(se) for v, (_, se) in stats.items()},
        "eval_samples_per_version": {v: len(held_out[v]) for v in stats},
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def format_steps(state: RunState) -> str:
    """Per optimizer step: reward, loss, and the training targets naive / capped / deduplicated."""
    head = (
        f"{'step':>4} {'reward':>7} {'+-std':>6} {'execs':>5} {'loss':>9} {'grad':>6} "
        f"{'targets naive':>13} {'capped':>9} {'dedup':>9} {'-% naive':>8} {'step s':>7}"
    )
    lines = [head]
    for k in sorted(state.steps):
        s = state.steps[k]
        saved = f"{1 - s.targets_dedup / s.targets_naive:.0%}" if s.targets_naive else "-"
        lines.append(
            f"{k:>4} {s.reward_mean:>7.3f} {s.reward_std:>6.3f} {s.num_executions:>5} {s.loss:>9.4f} "
            f"{s.grad_norm:>6.2f} {s.targets_naive:>13} {s.targets_capped:>9} {s.targets_dedup:>9} "
            f"{saved:>8} {s.seconds:>7.1f}"
        )
    return "\n".join(lines)


_COMPARE_ROWS = (
    ("mode", lambda s: s["mode"] or "-"),
    ("wall time", lambda s: format_duration(s["duration_s"])),
    ("steps done", lambda s: f"{s['num_steps']}/{s['num_steps_planned'] or '?'}"),
    ("reward first 3", lambda s: _f(s["reward_first3"])),
    ("reward last 3", lambda s: _f(s["reward_last3"])),
    ("held-out first", lambda s: _pm(s["eval_reward_first"], s["eval_reward_se_first"])),
    ("held-out last", lambda s: _pm(s["eval_reward_last"], s["eval_reward_se_last"])),
    ("held-out rise", lambda s: _pm(s["eval_rise"], s["eval_rise_se"])),
    ("executions", lambda s: " ".join(f"{k} {v}" for k, v in s["executions"].items()) or "-"),
    ("role switches", lambda s: str(s["num_role_switches"])),
    ("switch to train s", lambda s: _f(s["switch_s"].get("to_train"))),
    ("switch to rollout s", lambda s: _f(s["switch_s"].get("to_rollout"))),
    ("calls/s", lambda s: f"{s['calls_per_s']:.2f}"),
    ("output tokens", lambda s: str(s["output_tokens"])),
    ("targets naive", lambda s: str(s["targets"]["naive"])),
    ("targets dedup", lambda s: str(s["targets"]["dedup"])),
    ("saved by cap", lambda s: f"{s['targets']['saved_by_cap']:.1%}"),
    ("saved by dedup", lambda s: f"{s['targets']['saved_by_dedup']:.1%}"),
    ("mean busy (cells)", lambda s: f"{_mean_busy(s):.1%}"),
    ("failures", lambda s: str(sum(s["failures"].values()))),
)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _pm(x: float | None, se: float | None) -> str:
    """A mean with its standard error."""
    return _f(x) if se is None or x is None else f"{x:.3f} +- {se:.3f}"


def _mean_busy(s: dict) -> float:
    cells = s["cell_utilisation"].values()
    return fmean(c["rollout busy"] + c["train busy"] for c in cells) if cells else 0.0


def format_summary(name: str, s: dict, stats: ReadStats) -> str:
    """One run's summary: the comparison rows, per-cell time by role, switch phases, what reading found."""
    lines = [f"== {name}"] + [f"  {label:<22} {fn(s)}" for label, fn in _COMPARE_ROWS[1:]]
    for cell, shares in s["cell_role_share"].items():
        parts = s["cell_utilisation"][cell]
        busy = {r: parts[f"{r} busy"] / shares[r] for r in ("rollout", "train") if shares.get(r)}
        lines.append(
            f"  cell {cell:<18} "
            + "  ".join(f"{r} {v:.1%}" + (f" (busy {busy[r]:.0%})" if r in busy else "") for r, v in shares.items())
        )
    for cell, ranks in s["rank_train_busy_s"].items():
        lines.append(
            f"  cell {cell:<4} train busy by rank  " + "  ".join(f"rank {r} {v:.1f} s" for r, v in ranks.items())
        )
    if s["switch_phase_s"]:
        lines.append("  switch phases (mean s)  " + "  ".join(f"{p} {v:.2f}" for p, v in s["switch_phase_s"].items()))
    for cell, phases in s["rank_switch_phase_s"].items():
        lines.append(
            f"  cell {cell:<4} phases by rank (s)  "
            + "  ".join(f"{p} " + "/".join(f"{v:.2f}" for v in by_rank) for p, by_rank in phases.items())
        )
    if s["executions_continued"] or s["executions_rerun"]:
        lines.append(
            f"  across restarts         {s['executions_continued']} continued "
            f"({s['tokens_kept_by_continue']} tokens kept), {s['executions_rerun']} re-run"
        )
    if s["exclusions"]:
        lines.append("  exclusions              " + "  ".join(f"{r} {n}" for r, n in s["exclusions"].items()))
    lines.append(
        f"  events                  {stats.num_read} read, {stats.num_torn} torn last line, "
        f"{len(stats.invalid)} invalid"
    )
    return "\n".join(lines)


def format_compare(names: list[str], summaries: list[dict]) -> str:
    """Runs side by side, one column each."""
    rows = [(label, [fn(s) for s in summaries]) for label, fn in _COMPARE_ROWS]
    width = 2 + max(len(x) for x in [*names, *(v for _, values in rows for v in values)])
    lines = [f"{'':<22}" + "".join(f"{n:>{width}}" for n in names)]
    lines += [f"{label:<22}" + "".join(f"{v:>{width}}" for v in values) for label, values in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gyre-report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories holding events.jsonl")
    parser.add_argument("--out", type=Path, default=Path("."), help="where compare.png goes (two or more runs)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of every summary")
    args = parser.parse_args(argv)
    names, summaries, states = [], [], []
    for run_dir in args.run_dirs:
        events_path = RunPaths(run_dir).events
        if not events_path.is_file():
            print(f"gyre-report: {events_path}: no such file", file=sys.stderr)
            return 2
        state, stats = load_run(run_dir)
        name, summary = run_name(state, run_dir), summarize(state)
        figures = write_figures(state, run_dir, name)
        print(format_summary(name, summary, stats))
        print(format_steps(state))
        print("figures: " + (" ".join(str(p) for p in figures) or "none (no events)"))
        names.append(name)
        summaries.append(summary)
        states.append(state)
    if len(summaries) > 1:
        args.out.mkdir(parents=True, exist_ok=True)
        plot_compare(states, names, args.out / "compare.png")
        draw_timelines([timeline_panel(s, n) for s, n in zip(states, names)], args.out / "compare_timeline.png")
        print(
            f"\n{format_compare(names, summaries)}\ncompare: {args.out / 'compare.png'} "
            f"{args.out / 'compare_timeline.png'}"
        )
    if args.json:
        print(jsonio.dumps({"runs": dict(zip(names, summaries))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
