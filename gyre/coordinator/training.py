"""The training side of the run: ready groups stream to the core as micro-batches; it steps once.

    group ready ─> make_group_batch ─> StepRecord.groups ─(core in TRAIN)─> MicroBatches ─> core
    the step's every group accounted ─> EndStep;  StepProgress(ids) ─> groups whose ids are all trained

Micro-batch k of group g at step s is (s, g, k) everywhere (gyre.control.messages.MicroBatchId):
the core's per-micro-batch record (gyre.train.core_state) is the one step ledger; here a step is a
plain map of its groups, and a group is ready training work (what the policy counts) until the core
has reported every one of its ids trained.
    StepDone ─> version + 1 ─> engines of serving cells load it ─> checkpoint ─> ledger: trained

Executions are written to the ledger as trained only once the checkpoint that holds their step is
complete, so a resume never loses one and never trains one twice.
"""

from dataclasses import dataclass, field

from gyre.control.messages import (
    CheckpointDone,
    EndStep,
    MicroBatches,
    MicroBatchId,
    SaveCheckpoint,
    StepDone,
    StepProgress,
)
from gyre.coordinator.batching import GroupBatch, make_group_batch
from gyre.coordinator.source import Group
from gyre.engines.published import PublishedWeights
from gyre.scheduler.cells import SchedulerError
from gyre.scheduler.streaming import check_staleness
from gyre.trajectory.config import TrajectoryConfig


@dataclass
class StepRecord:
    """What one optimizer step trained and how it went (for events, the summary, the ledger)."""

    step: int
    groups: list[tuple[Group, GroupBatch]] = field(default_factory=list)
    """Every group of the step, trainable or excluded, in the order they became ready."""
    metrics: dict = field(default_factory=dict)
    seconds: float = 0.0
    untrained: dict[int, set[MicroBatchId]] = field(default_factory=dict)
    """Group -> the ids of its micro-batches the core has not reported trained (sent or not)."""
    unsent: list[int] = field(default_factory=list)
    """Groups whose micro-batches have not gone to the core yet."""
    ended: bool = False

    @property
    def rewards(self) -> list[float]:
        return [r for _, b in self.groups for r in b.rewards.values()]

    @property
    def started(self) -> bool:
        """A group of the step is trained whole."""
        return any(b.micro_batches and g.index not in self.untrained for g, b in self.groups)


class Training:
    """The run's steps as plain maps of groups; the ready work the policy sees (gyre.scheduler.observe.ReadyWork).

    Args:
        replicas: a training cell's data-parallel replicas: each group makes at least this many micro-batches.
        train_tok_s: training throughput of one cell, tokens/s: the configured guess until a step measures it.
    """

    def __init__(
        self,
        *,
        groups_per_step: int,
        staleness: int,
        trajectory: TrajectoryConfig,
        max_tokens: int,
        version: int,
        train_tok_s: float,
        weights: PublishedWeights | None = None,
        replicas: int = 1,
    ):
        self.groups_per_step, self.staleness, self.version = groups_per_step, staleness, version
        self.trajectory, self.max_tokens, self.replicas = trajectory, max_tokens, replicas
        self.steps: dict[int, StepRecord] = {}
        self.train_tok_s = train_tok_s
        self.uncheckpointed: list[StepRecord] = []
        self.weights = weights
        """The newest published weights."""

    @property
    def optimizing(self) -> bool:
        """The current step's batch is complete and the core is finishing it."""
        rec = self.steps.get(self.version)
        return rec is not None and rec.ended

    def _record(self, step: int) -> StepRecord:
        if step < self.version:
            raise SchedulerError(f"step {step} is already applied (version {self.version})")
        return self.steps.setdefault(step, StepRecord(step))

    def add_group(self, group: Group) -> GroupBatch:
        """Turn a ready group into micro-batches of its step (excluded as a whole if nothing trains)."""
        rec = self._record(group.step)
        if len(rec.groups) >= self.groups_per_step:
            raise SchedulerError(f"step {group.step} got more than {self.groups_per_step} groups")
        batch = make_group_batch(
            [(ex.records_path, ex.evaluation) for ex in group.executions],
            group.step,
            self.staleness,
            self.trajectory,
            self.max_tokens,
            self.replicas,
        )
        group.batched = True
        rec.groups.append((group, batch))
        if batch.micro_batches:
            rec.untrained[group.index] = {(group.step, group.index, k) for k in range(len(batch.micro_batches))}
            rec.unsent.append(group.index)
        return batch

    # ---- the ready work the policy sees (gyre.scheduler.observe.ReadyWork) --------------------
    def _tokens(self, rec: StepRecord) -> int:
        return sum(sum(mb.num_tokens for mb in b.micro_batches) for g, b in rec.groups if g.index in rec.untrained)

    def ready_tokens(self) -> int:
        """Tokens of the current step's groups not yet trained."""
        rec = self.steps.get(self.version)
        return self._tokens(rec) if rec else 0

    def ready_tokens_ahead(self) -> int:
        """Tokens of groups already placed in later steps."""
        return sum(self._tokens(rec) for step, rec in self.steps.items() if step > self.version)

    def batch_ready(self) -> bool:
        """Every group of the current step is ready or excluded."""
        rec = self.steps.get(self.version)
        return rec is not None and len(rec.groups) == self.groups_per_step

    def step_started(self) -> bool:
        rec = self.steps.get(self.version)
        return rec is not None and rec.started

    # ---- the core's side -----------------------------------------------------------------------
    def to_send(self) -> list:
        """Messages for the core now (it must be in TRAIN): new micro-batches of the current step,
        then EndStep once every group of the step is accounted for.

        Raises:
            StalenessError: a group's oldest trained target is older than the bound allows.
        """
        rec, out = self._record(self.version), []
        batches = {g.index: b for g, b in rec.groups}
        for gi in rec.unsent:
            check_staleness(batches[gi].min_version, rec.step, self.staleness)
            out.append(MicroBatches(rec.step, gi, batches[gi].micro_batches))
        rec.unsent = []
        if not rec.ended and self.batch_ready():
            out.append(EndStep(rec.step))
            rec.ended = True
        return out

    def on_progress(self, msg: StepProgress) -> None:
        """Groups whose micro-batches are all trained leave the ready work."""
        rec = self.steps.get(msg.step)
        if rec is None:
            return
        done = {tuple(i) for i in msg.done}
        for gi in list(rec.untrained):
            if rec.untrained[gi] <= done:
                del rec.untrained[gi]

    def on_step_done(self, msg: StepDone, num_train_cells: int) -> StepRecord:
        if not self.batch_ready():
            raise SchedulerError(f"step {self.version} is done but not every group of it was accounted for")
        rec = self.steps.pop(msg.step)
        rec.metrics, rec.seconds, rec.untrained = msg.metrics, msg.seconds, {}
        self.version += 1
        if msg.version != self.version:
            raise RuntimeError(f"core reports version {msg.version}, the run is at {self.version}")
        tokens = msg.metrics.get("num_tokens", 0)
        if tokens and msg.seconds > 0:
            self.train_tok_s = tokens / msg.seconds / max(1, num_train_cells)
        self.weights = msg.weights
        self.uncheckpointed.append(rec)
        return rec

    def checkpoint(self, extra: dict) -> SaveCheckpoint:
        return SaveCheckpoint(self.version, extra)

    def on_checkpoint_done(self, msg: CheckpointDone) -> list[StepRecord]:
        """Steps now durable (their executions can be written to the ledger as trained)."""
        done = [r for r in self.uncheckpointed if r.step < msg.step]
        self.uncheckpointed = [r for r in self.uncheckpointed if r.step >= msg.step]
        return done
