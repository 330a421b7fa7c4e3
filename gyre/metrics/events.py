"""The typed events every process of a run emits (the contract between emitters and every view).

Each event is a frozen dataclass with a `kind` (its name on disk) and `t`, unix seconds when it
happened (defaults to now). On disk an event is one JSON object per line: {"kind": ..., fields...}
(see gyre.metrics.log). Views (TensorBoard, progress, plots, report) fold these events in
gyre.metrics.state; nothing reads a process's memory.

Field names follow the parts that produce the figures: an optimizer step's loss statistics are
`gyre.train.loss.finish_stats`'s (plus the trainer's `grad_norm`), its token counts are
`gyre.trajectory.process.TokenCounts`'s, so an emitter passes them through by name.
"""

import time
from dataclasses import dataclass, field, fields
from typing import ClassVar

from gyre.common import jsonio
from gyre.scheduler.cells import Role
from gyre.trajectory.rewards import LEDGER_STATES, LedgerState

ROLES = tuple(r.value for r in Role)
"""`gyre.scheduler.cells.Role` values (cells report them as strings)."""


class EventError(ValueError):
    """An event whose fields break the contract (the emitter's bug) or a line that is no event."""


@dataclass(frozen=True, kw_only=True)
class Event:
    """Base of every event: its on-disk `kind` and when it happened."""

    kind: ClassVar[str] = ""
    t: float = field(default_factory=time.time)
    """When it happened (for spans: when they ended), unix seconds."""


@dataclass(frozen=True, kw_only=True)
class RunStart(Event):
    """The coordinator's first event: what the run is, so a report needs nothing but the JSONL."""

    kind: ClassVar[str] = "run_start"
    mode: str
    """Scheduler mode: elastic, async or colocate."""
    num_steps: int
    num_cells: int
    cell_ranks: int = 1
    """Ranks (trainer processes) per cell, the same in every cell."""
    core_cell: int | None = 0
    """Index of the core cell (None: no core, e.g. every cell trains in turn)."""
    name: str = ""
    """A label for comparisons (default: the run directory's name)."""
    start_step: int = 0
    """The weight version it starts from (> 0 when it resumes a checkpoint)."""
    weights_digest: str = ""
    """Digest of the core's weights at start (equal to the resumed checkpoint's)."""


@dataclass(frozen=True, kw_only=True)
class ModelCall(Event):
    """One model call answered by the proxy (t = when the answer completed)."""

    kind: ClassVar[str] = "model_call"
    execution_id: str
    agent_id: str
    cell: int | None
    """Index of the cell whose engine served it (None: not known to the proxy)."""
    engine_id: str
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    latency_s: float


@dataclass(frozen=True, kw_only=True)
class ExecutionState(Event):
    """An execution's ledger state change."""

    kind: ClassVar[str] = "execution_state"
    execution_id: str
    task_id: str
    group_id: str
    step: int
    """The RL step whose batch the execution belongs to."""
    state: LedgerState
    reason: str | None = None
    """Why it was excluded or timed out (e.g. missing_call, uniform_group)."""
    reward: float | None = None
    """The evaluator's score (0..1) once known."""
    duration_s: float | None = None
    """Harness wall time (finished / timed_out; a continued execution's: the time before the break)."""
    tokens_kept: int | None = None
    """queued, reason continued: prompt and output tokens of its calls before the break, not generated again."""

    def __post_init__(self):
        if self.state not in LEDGER_STATES:
            raise EventError(f"execution state must be one of {', '.join(LEDGER_STATES)}; got {self.state!r}")


@dataclass(frozen=True, kw_only=True)
class HeldOutResult(Event):
    """One execution of a held-out task (never trained on), rolled out under weight version `version`."""

    kind: ClassVar[str] = "held_out_result"
    execution_id: str
    task_id: str
    version: int
    """The weight version the engines served when it started (0 at the start, num_steps at the end)."""
    outcome: str
    """How it ended (`gyre.trajectory.rewards.OUTCOMES`); reward None: no score (evaluator error, no calls)."""
    reward: float | None = None
    """The evaluator's score; None when it has none (then it counts in no mean)."""


@dataclass(frozen=True, kw_only=True)
class RoleSwitchEvent(Event):
    """A cell finished switching roles: from_role until t_start, then `phases` in order, then to_role."""

    kind: ClassVar[str] = "role_switch"
    cell: int
    from_role: str
    to_role: str
    t_start: float
    """When the switch began, unix seconds (t is when it ended)."""
    phases: dict[str, float]
    """Phase name (`gyre.scheduler.cells.Phase` values) -> the cell's seconds (its slowest rank's),
    in the order they ran."""
    rank_phases: dict[str, list[float]] = field(default_factory=dict)
    """Phase name -> each rank's seconds until it had done its part (gyre.cells.serving)."""


@dataclass(frozen=True, kw_only=True)
class MicroStepEvent(Event):
    """A training micro-step computed by a cell (t = when it ended)."""

    kind: ClassVar[str] = "micro_step"
    step: int
    index: int
    cell: int
    tokens: int
    seconds: float
    rank: int = 0
    """The rank of the cell that computed it (its data-parallel share; with tensor parallel every
    rank of its group computed it with this one)."""


@dataclass(frozen=True, kw_only=True)
class OptimizerStep(Event):
    """An optimizer step applied on the core: the loss's statistics and the batch's token counts."""

    kind: ClassVar[str] = "optimizer_step"
    step: int
    loss: float
    clip_fraction: float
    truncated_fraction: float
    ratio_mean: float
    logprob_gap_mean: float
    """Mean |log pi_theta - log pi_behaviour| over targets: the divergence figure the loss reports."""
    entropy_mean: float | None
    """None when the trainer did not compute entropies."""
    kl_mean: float | None = None
    """Mean k3 estimate of KL(pi_theta || pi_behaviour) per target (None: not reported, e.g. older runs)."""
    grad_norm: float
    reward_mean: float
    reward_std: float
    num_executions: int
    targets_naive: int
    """Targets over every trainable path, each its own sample (no path cap, no dedup)."""
    targets_capped: int
    """Targets over the selected (at most K) paths."""
    targets_dedup: int
    """Unique targets over the selected paths: what the loss trained."""
    seq_tokens_naive: int = 0
    seq_tokens_capped: int = 0
    seq_tokens_packed: int = 0
    seq_tokens_tree: int = 0
    seconds: float
    """Wall time of the step, from its first micro-step to the applied update."""


@dataclass(frozen=True, kw_only=True)
class WeightPublish(Event):
    kind: ClassVar[str] = "weight_publish"
    version: int
    seconds: float
    num_engines: int


@dataclass(frozen=True, kw_only=True)
class Checkpoint(Event):
    kind: ClassVar[str] = "checkpoint"
    step: int
    path: str
    seconds: float
    weights_digest: str = ""
    """Digest of the core's weights as saved."""


@dataclass(frozen=True, kw_only=True)
class Exclusion(Event):
    """An execution left out of training, and why (the trajectory processor's reasons)."""

    kind: ClassVar[str] = "exclusion"
    execution_id: str | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class FailureEvent(Event):
    """A component failed (engine crash, lost cell, harness error); the run went on or stopped."""

    kind: ClassVar[str] = "failure"
    component: str
    message: str


@dataclass(frozen=True, kw_only=True)
class ObservationEvent(Event):
    """The coordinator's sample of the cluster (about every second)."""

    kind: ClassVar[str] = "observation"
    queued: int
    running: int
    roles: list[str]
    """Each cell's role (ROLES), indexed by cell."""
    sessions: list[int]
    """Each cell's live sessions (0 for cells not serving)."""
    gen_tok_s: list[float] = field(default_factory=list)
    """Each cell's decode capacity, tokens/s, as the policy saw it (empty: not measured yet)."""
    gen_demand_tok_s: float = 0.0
    """Decode the live calls would draw at full per-session speed, tokens/s (gyre.scheduler.decode)."""

    @property
    def waterlevel(self) -> int:
        return self.queued + self.running


EVENT_TYPES: dict[str, type[Event]] = {
    c.kind: c
    for c in (
        RunStart,
        ModelCall,
        ExecutionState,
        HeldOutResult,
        RoleSwitchEvent,
        MicroStepEvent,
        OptimizerStep,
        WeightPublish,
        Checkpoint,
        Exclusion,
        FailureEvent,
        ObservationEvent,
    )
}
_FIELDS = {k: frozenset(f.name for f in fields(c)) for k, c in EVENT_TYPES.items()}


def _builtin(value):
    """numpy / torch scalars and arrays as Python numbers and lists (json calls this only for them)."""
    for method in ("item", "tolist"):
        if hasattr(value, method):
            return getattr(value, method)()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def encode_event(event: Event) -> bytes:
    """The event as one JSON line, newline included (field order: kind, then the dataclass's)."""
    return jsonio.dumpb({"kind": event.kind, **event.__dict__}, default=_builtin) + b"\n"


def decode_event(obj: dict) -> Event:
    """The event of one parsed JSON line.

    Raises:
        EventError: unknown kind, unknown or missing fields, or values breaking the contract.
    """
    kind = obj.get("kind")
    if kind not in EVENT_TYPES:
        raise EventError(f"unknown event kind {kind!r}")
    args = {k: v for k, v in obj.items() if k != "kind"}
    extra = set(args) - _FIELDS[kind]
    if extra:
        raise EventError(f"{kind}: unknown fields {sorted(extra)}")
    try:
        return EVENT_TYPES[kind](**args)
    except TypeError as e:
        raise EventError(f"{kind}: {e}") from None
