"""Live progress of a run: a rich table on a terminal, plain rate-limited lines in a Slurm log.

`make_snapshot` (pure) picks the figures from a RunState; `format_line` and `make_table` render
them; `Progress` decides where and how often.
"""

import sys
import time
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console
from rich.live import Live
from rich.table import Table

from gyre.metrics.config import MetricsConfig
from gyre.metrics.state import RunState

ROLE_MARKS = {"rollout": "R", "train": "T", "to_train": "R>T", "to_rollout": "T>R", "lost": "X"}


@dataclass(frozen=True)
class Snapshot:
    steps_done: int
    num_steps: int | None
    elapsed_s: float
    waterlevel: int
    queued: int
    running: int
    roles: tuple[str, ...]
    calls_per_s: float
    output_tokens_per_s: float
    reward_mean: float | None
    num_excluded: int
    num_failures: int
    eta_s: float | None


def make_snapshot(state: RunState, now: float, num_steps: int | None = None) -> Snapshot:
    """The progress figures at `now` (unix seconds). ETA: the mean step time so far times the steps left."""
    obs = state.last_observation
    total = num_steps if num_steps is not None else (state.run.num_steps if state.run else None)
    done = len(state.steps)
    start = state.run.t if state.run else state.t_first
    elapsed = max(0.0, now - start) if start is not None else 0.0
    eta = None
    if total is not None and done:
        last = state.steps[max(state.steps)].t
        eta = max(0.0, (last - start) / done * (total - done) - (now - last))
    calls_s, tokens_s = state.rates()
    last_step = state.steps[max(state.steps)] if state.steps else None
    return Snapshot(
        steps_done=done,
        num_steps=total,
        elapsed_s=elapsed,
        waterlevel=obs.waterlevel if obs else 0,
        queued=obs.queued if obs else 0,
        running=obs.running if obs else 0,
        roles=tuple(obs.roles) if obs else (),
        calls_per_s=calls_s,
        output_tokens_per_s=tokens_s,
        reward_mean=last_step.reward_mean if last_step else None,
        num_excluded=sum(state.exclusions.values()),
        num_failures=sum(state.failures.values()),
        eta_s=eta,
    )


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def format_line(s: Snapshot) -> str:
    """One plain progress line (for logs)."""
    cells = " ".join(f"{i}:{ROLE_MARKS.get(r, r)}" for i, r in enumerate(s.roles)) or "-"
    reward = f"{s.reward_mean:.3f}" if s.reward_mean is not None else "-"
    return (
        f"step {s.steps_done}/{s.num_steps or '?'} | {format_duration(s.elapsed_s)} | waterlevel {s.waterlevel} "
        f"(queued {s.queued}, running {s.running}) | cells {cells} | {s.calls_per_s:.2f} calls/s "
        f"{s.output_tokens_per_s:.0f} tok/s | reward {reward} | excluded {s.num_excluded} | "
        f"failures {s.num_failures} | ETA {format_duration(s.eta_s)}"
    )


def make_table(s: Snapshot) -> Table:
    """The live display: one figure per row (fits an 80-column terminal whatever the cell count)."""
    table = Table(title="gyre run", title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    reward = f"{s.reward_mean:.3f}" if s.reward_mean is not None else "-"
    rows = (
        (
            "step",
            f"{s.steps_done}/{s.num_steps or '?'}   elapsed {format_duration(s.elapsed_s)}   "
            f"ETA {format_duration(s.eta_s)}",
        ),
        ("waterlevel", f"{s.waterlevel} (queued {s.queued}, running {s.running})"),
        ("cells", " ".join(f"{i}:{ROLE_MARKS.get(r, r)}" for i, r in enumerate(s.roles)) or "-"),
        ("rollout", f"{s.calls_per_s:.2f} calls/s   {s.output_tokens_per_s:.0f} tok/s"),
        ("reward", f"{reward} (last trained batch)"),
        ("excluded", f"{s.num_excluded}   failures {s.num_failures}"),
    )
    for key, value in rows:
        table.add_row(key, value)
    return table


class Progress:
    """Shows a RunState as it grows: call `update(state)` from the run's loop, `close(state)` at the end."""

    def __init__(self, cfg: MetricsConfig, *, num_steps: int | None = None, stream: TextIO | None = None):
        self._console = Console(file=stream or sys.stdout)
        self.mode = cfg.progress
        if self.mode == "auto":
            self.mode = "live" if self._console.is_terminal else "plain"
        self._interval_s, self._num_steps = cfg.progress_interval_s, num_steps
        self._last_line_s: float | None = None
        self._last_steps = -1
        self._live: Live | None = None

    def update(self, state: RunState, now: float | None = None) -> None:
        """Redraw (live) or print a line if one is due: a new optimizer step, or `progress_interval_s` passed."""
        now = time.time() if now is None else now
        if self.mode == "off":
            return
        snap = make_snapshot(state, now, self._num_steps)
        if self.mode == "live":
            if self._live is None:
                self._live = Live(make_table(snap), console=self._console, auto_refresh=False)
                self._live.start()
            self._live.update(make_table(snap), refresh=True)
            return
        due = self._last_line_s is None or now - self._last_line_s >= self._interval_s
        if due or snap.steps_done != self._last_steps:
            self._console.out(format_line(snap), highlight=False)
            self._last_line_s, self._last_steps = now, snap.steps_done

    def close(self, state: RunState, now: float | None = None) -> None:
        """The last figures, always shown (plain: one final line)."""
        if self.mode == "off":
            return
        if self._live is not None:
            self.update(state, now)
            self._live.stop()
            self._live = None
        else:
            self._last_line_s = None
            self.update(state, now)
