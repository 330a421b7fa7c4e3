"""The coordinator's view of its own run: follows events.jsonl and feeds every live view.

    proxy, cell leaders, coordinator ─EventLog.emit─> events.jsonl
    RunMonitor.update() (the coordinator's loop, ~1/s):
        EventTail.read_new() ─> RunState.add ─> make_scalars ─> TensorBoard, W&B
                                            └─> Progress (live table / plain lines)
                                            └─> figures, every plots_interval_s ─> W&B images

Following the file rather than the coordinator's own emits is what makes other processes' events
(the proxy's model calls, the cell leaders' switches) count in calls/s and in TensorBoard. A view
that fails is logged once and counted in `view_errors`; the run goes on.
"""

import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import TextIO

from gyre.common.run_paths import RunPaths
from gyre.metrics.config import MetricsConfig
from gyre.metrics.events import Event
from gyre.metrics.log import EventTail
from gyre.metrics.plots import write_figures
from gyre.metrics.progress import Progress
from gyre.metrics.report import run_name, summarize
from gyre.metrics.sinks import MetricsSink, TensorBoardSink, WandbSink, make_scalars
from gyre.metrics.state import RunState

log = logging.getLogger(__name__)


class RunMonitor:
    """Usage: `monitor = RunMonitor(run_dir, cfg, num_steps=N)`; `monitor.update()` each loop
    iteration; `summary = monitor.close()` at the end (also after a failure)."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        cfg: MetricsConfig,
        *,
        num_steps: int | None = None,
        stream: TextIO | None = None,
    ):
        self.run_dir, self.cfg = Path(run_dir), cfg
        self.state = RunState(rate_window_s=cfg.rate_window_s)
        self.view_errors: Counter = Counter()
        """View name -> failures (the first of each is logged)."""
        self._tail = EventTail(RunPaths(self.run_dir).events)
        self._progress = Progress(cfg, num_steps=num_steps, stream=stream)
        factories = {}
        if cfg.tensorboard:
            factories["tensorboard"] = lambda: TensorBoardSink(self.run_dir / cfg.tensorboard_dir)
        if cfg.wandb:
            factories["wandb"] = lambda: WandbSink(self.run_dir, cfg, self.run_dir.name)
        self._sinks: dict[str, MetricsSink] = {}
        for name, make in factories.items():
            self._guard(name, lambda name=name, make=make: self._sinks.update({name: make()}))
        self._plots_at: float | None = None
        self._sampled_at: float | None = None
        """When the last cluster sample went to the sinks (event time)."""

    def update(self, now: float | None = None) -> None:
        """Fold the events appended since the last call into every view; never raises."""
        now = self._fold(now)
        interval = self.cfg.plots_interval_s
        if self._plots_at is None:  # the first figures once there is a run to draw, not its empty start
            self._plots_at = now
        elif interval and now - self._plots_at >= interval:
            self._plots_at = now
            self._draw()

    def close(self, now: float | None = None) -> dict:
        """Read the last events, draw the figures, close the sinks; returns the run's summary."""
        now = self._fold(now)
        self._draw()
        self._guard("progress", lambda: self._progress.close(self.state, now))
        for name, sink in self._sinks.items():
            self._guard(name, sink.close)
        self._sinks.clear()
        return summarize(self.state) | {"view_errors": dict(self.view_errors)}

    def _fold(self, now: float | None) -> float:
        now = time.time() if now is None else now
        events: list[Event] = []
        self._guard("events", lambda: events.extend(self._tail.read_new()))
        for e in events:
            self._guard("fold", lambda e=e: self._add(e))
        self._guard("progress", lambda: self._progress.update(self.state, now))
        return now

    def _add(self, e: Event) -> None:
        self.state.add(e)
        scalars = make_scalars(e, self.state)
        if scalars is None:
            return
        if scalars.axis == "elapsed_s":
            if self._sampled_at is not None and e.t - self._sampled_at < self.cfg.sample_interval_s:
                return
            self._sampled_at = e.t
        for name, sink in list(self._sinks.items()):
            self._guard(name, lambda sink=sink: sink.write(e, scalars))

    def _draw(self) -> None:
        if not self.cfg.figures:
            return
        paths: list[Path] = []
        name = run_name(self.state, self.run_dir)
        self._guard("figures", lambda: paths.extend(write_figures(self.state, self.run_dir, name)))
        if not paths:
            return
        step = self.state.last_step or 0
        for sink_name, sink in list(self._sinks.items()):
            self._guard(sink_name, lambda sink=sink: sink.write_images(paths, step))

    def _guard(self, name: str, fn) -> None:
        try:
            fn()
        except Exception as e:
            if not self.view_errors[name]:
                log.warning("metrics: %s failed: %r (logged once, counted)", name, e, exc_info=True)
            self.view_errors[name] += 1
