"""A run as its events describe it: a pure fold (`RunState.add`) that every view reads.

TensorBoard, the live progress, the figures and the report all fold the same events.jsonl, so
what a report says of a finished run is what the progress showed while it ran.

Cell lanes: a cell holds the role of its first ObservationEvent (or its first switch's from_role) from
its first sight; a RoleSwitchEvent closes the old role at t_start, lays its phases end to end (any
remainder up to t stays the bare switching state), and opens to_role at t. An ObservationEvent that
shows a cell lost ends its lane there. Busy time: a model call occupies its cell over
[t - latency_s, t], a micro-step over [t - seconds, t]; overlaps count once.
"""

import math
from bisect import bisect_right
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import accumulate
from statistics import fmean, stdev

from gyre.metrics.events import (
    ROLES,
    Checkpoint,
    Event,
    Exclusion,
    ExecutionState,
    FailureEvent,
    HeldOutResult,
    MicroStepEvent,
    ModelCall,
    ObservationEvent,
    OptimizerStep,
    RoleSwitchEvent,
    RunStart,
    WeightPublish,
)

SWITCHING = {"train": "to_train", "rollout": "to_rollout"}
"""Switching state of a switch, by its target role."""
_COMPACT_AT = 4096


@dataclass(frozen=True)
class Span:
    t0: float
    t1: float
    role: str
    phase: str | None = None


@dataclass(frozen=True)
class TimelinePanel:
    """What a timeline draws of one run: (label, spans) per cell and the waterlevel samples, in seconds."""

    title: str
    lanes: list[tuple[str, list[Span]]]
    levels: list[tuple[float, int]]
    t0: float
    t1: float


class Intervals:
    """A union of intervals: added in any order (calls end out of order), measured in O(log n)."""

    def __init__(self):
        self._items: list[tuple[float, float]] = []
        self._num_merged = 0
        """The first `_num_merged` items are sorted and disjoint; `_before[i]` is their length before item i."""
        self._before: list[float] = [0.0]

    def add(self, t0: float, t1: float) -> None:
        if t1 > t0:
            self._items.append((t0, t1))
            if len(self._items) - self._num_merged > _COMPACT_AT:
                self._compact()

    def _compact(self) -> None:
        if self._num_merged == len(self._items):
            return
        out: list[tuple[float, float]] = []
        for a, b in sorted(self._items):
            if out and a <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        self._items, self._num_merged = out, len(out)
        self._before = list(accumulate((b - a for a, b in out), initial=0.0))

    def _covered_until(self, t: float) -> float:
        i = bisect_right(self._items, (t, float("inf"))) - 1
        if i < 0:
            return 0.0
        a, b = self._items[i]
        return self._before[i] + min(t, b) - a

    def overlap_s(self, t0: float, t1: float) -> float:
        """Seconds of the union inside [t0, t1]."""
        self._compact()
        return max(0.0, self._covered_until(t1) - self._covered_until(t0))


@dataclass
class CellLane:
    index: int
    role: str
    since: float
    spans: list[Span] = field(default_factory=list)
    busy: dict[str, Intervals] = field(default_factory=lambda: {"rollout": Intervals(), "train": Intervals()})
    num_calls: int = 0
    num_micro_steps: int = 0
    rank_train_s: dict[int, float] = field(default_factory=dict)
    """Rank -> seconds it computed micro-steps (one rank's micro-steps never overlap)."""
    rank_phase_s: dict[str, list[list[float]]] = field(default_factory=dict)
    """Switch phase -> each time it ran, its seconds by rank."""

    def close(self, t: float) -> None:
        if t > self.since:
            self.spans.append(Span(self.since, t, self.role))
        self.since = max(self.since, t)

    def spans_until(self, t_end: float) -> list[Span]:
        """Every span, the open one ending at `t_end`."""
        return self.spans + ([Span(self.since, t_end, self.role)] if t_end > self.since else [])


@dataclass
class RunState:
    """Everything the views show, folded from events in file order."""

    rate_window_s: float = 60.0
    run: RunStart | None = None
    t_first: float | None = None
    t_last: float | None = None
    cells: dict[int, CellLane] = field(default_factory=dict)
    levels: list[tuple[float, int]] = field(default_factory=list)
    """(t, waterlevel) at each change (and the latest sample)."""
    last_observation: ObservationEvent | None = None
    steps: dict[int, OptimizerStep] = field(default_factory=dict)
    executions: dict[str, ExecutionState] = field(default_factory=dict)
    """Each execution's latest state."""
    continued: set[str] = field(default_factory=set)
    """Executions that continued their harness session across a restart."""
    num_rerun: int = 0
    """Executions a restart interrupted and that were re-run from the start."""
    tokens_kept: int = 0
    """Tokens of calls before a break that continuing did not generate again."""
    rewards: dict[str, tuple[int, float]] = field(default_factory=dict)
    """execution id -> (step, reward) once evaluated."""
    held_out: dict[int, list[float]] = field(default_factory=dict)
    """Weight version -> the rewards of the held-out executions rolled out under it."""
    exclusions: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)
    """By component."""
    last_failure: FailureEvent | None = None
    num_calls: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    recent_calls: deque = field(default_factory=deque)
    """(t, output tokens) of the calls inside the trailing rate window."""
    num_switches: int = 0
    phase_s: dict[str, list[float]] = field(default_factory=dict)
    """Phase name -> seconds of each time it ran."""
    switch_s: dict[str, list[float]] = field(default_factory=dict)
    """Switching state (to_train, to_rollout) -> seconds of each switch, begin to end."""
    publishes: list[WeightPublish] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    num_micro_steps: int = 0

    def add(self, e: Event) -> None:
        self.t_first = e.t if self.t_first is None else min(self.t_first, e.t)
        self.t_last = e.t if self.t_last is None else max(self.t_last, e.t)
        handler = _HANDLERS.get(type(e))
        if handler is not None:
            handler(self, e)

    # --- per kind ------------------------------------------------------------------------------
    def _run_start(self, e: RunStart) -> None:
        self.run = e

    def _model_call(self, e: ModelCall) -> None:
        self.num_calls += 1
        self.prompt_tokens += e.prompt_tokens
        self.output_tokens += e.output_tokens
        self.cached_tokens += e.cached_tokens
        self.recent_calls.append((e.t, e.output_tokens))
        while self.recent_calls and self.recent_calls[0][0] < self.t_last - self.rate_window_s:
            self.recent_calls.popleft()
        if e.cell is not None:
            lane = self._lane(e.cell, "rollout", e.t - e.latency_s)
            lane.num_calls += 1
            lane.busy["rollout"].add(e.t - e.latency_s, e.t)

    def _execution_state(self, e: ExecutionState) -> None:
        self.executions[e.execution_id] = e
        if e.state == "queued" and e.reason == "continued":
            self.continued.add(e.execution_id)
            self.tokens_kept += e.tokens_kept or 0
        elif e.state == "excluded" and e.reason == "interrupted":
            self.num_rerun += 1
        if e.reward is not None:
            self.rewards[e.execution_id] = (e.step, e.reward)

    def _held_out(self, e: HeldOutResult) -> None:
        if e.reward is not None:
            self.held_out.setdefault(e.version, []).append(e.reward)

    def _role_switch(self, e: RoleSwitchEvent) -> None:
        lane = self._lane(e.cell, e.from_role, e.t_start)
        lane.close(e.t_start)
        t, switching = e.t_start, SWITCHING.get(e.to_role, f"to_{e.to_role}")
        for phase, seconds in e.phases.items():
            if seconds > 0 and e.t > t:
                lane.spans.append(Span(t, min(t + seconds, e.t), switching, phase))
            t = min(t + seconds, e.t)
            self.phase_s.setdefault(phase, []).append(seconds)
        for phase, by_rank in e.rank_phases.items():
            lane.rank_phase_s.setdefault(phase, []).append(by_rank)
        if e.t > t:
            lane.spans.append(Span(t, e.t, switching))
        lane.role, lane.since = e.to_role, e.t
        self.num_switches += 1
        self.switch_s.setdefault(switching, []).append(e.t - e.t_start)

    def _micro_step(self, e: MicroStepEvent) -> None:
        lane = self._lane(e.cell, "train", e.t - e.seconds)
        lane.num_micro_steps += 1
        lane.busy["train"].add(e.t - e.seconds, e.t)
        lane.rank_train_s[e.rank] = lane.rank_train_s.get(e.rank, 0.0) + e.seconds
        self.num_micro_steps += 1

    def _optimizer_step(self, e: OptimizerStep) -> None:
        self.steps[e.step] = e

    def _weight_publish(self, e: WeightPublish) -> None:
        self.publishes.append(e)

    def _checkpoint(self, e: Checkpoint) -> None:
        self.checkpoints.append(e)

    def _exclusion(self, e: Exclusion) -> None:
        self.exclusions[e.reason] += 1

    def _failure(self, e: FailureEvent) -> None:
        self.failures[e.component] += 1
        self.last_failure = e

    def _observation(self, e: ObservationEvent) -> None:
        self.last_observation = e
        if not self.levels or self.levels[-1][1] != e.waterlevel:
            self.levels.append((e.t, e.waterlevel))
        elif len(self.levels) >= 2 and self.levels[-2][1] == e.waterlevel:
            self.levels[-1] = (e.t, e.waterlevel)  # a flat stretch keeps only its ends
        else:
            self.levels.append((e.t, e.waterlevel))
        for i, role in enumerate(e.roles):
            lane = self._lane(i, role, e.t)
            if role == "lost" and lane.role != "lost":
                lane.close(e.t)
                lane.role = "lost"

    def _lane(self, index: int, role: str, t: float) -> CellLane:
        if index not in self.cells:
            self.cells[index] = CellLane(index, role, t)
        return self.cells[index]

    # --- derived figures ---------------------------------------------------------------------
    @property
    def duration_s(self) -> float:
        return (self.t_last - self.t_first) if self.t_first is not None else 0.0

    @property
    def last_step(self) -> int | None:
        return max(self.steps) if self.steps else None

    def rates(self) -> tuple[float, float]:
        """(calls/s, output tokens/s) over the trailing rate window (or the run so far, if shorter)."""
        if self.t_last is None:
            return 0.0, 0.0
        window = min(self.rate_window_s, max(self.t_last - self.t_first, 1e-9))
        recent = [n for t, n in self.recent_calls if t >= self.t_last - window]
        return len(recent) / window, sum(recent) / window

    def outcomes(self) -> Counter:
        """Executions by their latest state."""
        return Counter(e.state for e in self.executions.values())

    def step_rewards(self) -> dict[int, list[float]]:
        """Step -> the rewards of its evaluated executions."""
        out: dict[int, list[float]] = {}
        for step, reward in self.rewards.values():
            out.setdefault(step, []).append(reward)
        return dict(sorted(out.items()))

    def role_time_s(self, index: int) -> dict[str, float]:
        """Seconds cell `index` spent in each role (switching states included) up to the last event."""
        out: dict[str, float] = {}
        for s in self.cells[index].spans_until(self.t_last):
            out[s.role] = out.get(s.role, 0.0) + (s.t1 - s.t0)
        return dict(sorted(out.items(), key=lambda kv: ROLES.index(kv[0]) if kv[0] in ROLES else len(ROLES)))

    def busy_s(self, index: int, role: str) -> float:
        """Seconds cell `index` was busy (serving a call / computing a micro-step) while in `role`."""
        lane = self.cells[index]
        return sum(lane.busy[role].overlap_s(s.t0, s.t1) for s in lane.spans_until(self.t_last) if s.role == role)


_HANDLERS = {
    RunStart: RunState._run_start,
    ModelCall: RunState._model_call,
    ExecutionState: RunState._execution_state,
    HeldOutResult: RunState._held_out,
    RoleSwitchEvent: RunState._role_switch,
    MicroStepEvent: RunState._micro_step,
    OptimizerStep: RunState._optimizer_step,
    WeightPublish: RunState._weight_publish,
    Checkpoint: RunState._checkpoint,
    Exclusion: RunState._exclusion,
    FailureEvent: RunState._failure,
    ObservationEvent: RunState._observation,
}


def fold(events, rate_window_s: float = 60.0) -> RunState:
    """The state after `events` (any iterable, consumed once)."""
    state = RunState(rate_window_s=rate_window_s)
    for e in events:
        state.add(e)
    return state


def mean_se(values: list[float]) -> tuple[float, float | None]:
    """A sample's mean and the standard error of that mean (sample std / sqrt n; None below 2 values)."""
    mean = fmean(values)
    return mean, (stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None)
