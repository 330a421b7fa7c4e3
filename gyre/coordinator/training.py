"""The training side of the run: ready groups stream to the core as micro-batches; it steps once.

    group ready ─> make_group_batch ─> MicroStepQueue[step] ─(core in TRAIN)─> MicroBatches ─> core
    the step's every group accounted ─> EndStep;  StepProgress(ids) ─> groups done in the queue

Micro-batch k of group g at step s is (s, g, k) everywhere (gyre.control.messages.MicroBatchId):
the core owns the open step and reports the ids it trained; nothing here counts them.
    StepDone ─> version + 1 ─> engines of serving cells load it ─> checkpoint ─> ledger: trained

A group is one micro-step of the queue (what the policy counts as ready training work) until the
core reports all its micro-batches trained. Executions are written to the ledger as trained only
once the checkpoint that holds their step is complete, so a resume never loses one and never
trains one twice.
"""

from dataclasses import dataclass, field

from gyre.control.messages import CheckpointDone, EndStep, MicroBatches, SaveCheckpoint, StepDone, StepProgress
from gyre.coordinator.batching import GroupBatch, make_group_batch
from gyre.coordinator.source import Group
from gyre.engines.published import PublishedWeights
from gyre.scheduler.streaming import MicroStep, MicroStepQueue
from gyre.trajectory.config import TrajectoryConfig


@dataclass
class StepRecord:
    """What one optimizer step trained and how it went (for events, the summary, the ledger)."""

    step: int
    groups: list[tuple[Group, GroupBatch]] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    seconds: float = 0.0
    sent: set[int] = field(default_factory=set)
    """Groups whose micro-batches went to the core."""
    micro: dict[int, tuple[MicroStep, int]] = field(default_factory=dict)
    """Group -> (its micro-step in the queue, its number of micro-batches), until the core trained them all."""
    ended: bool = False

    @property
    def rewards(self) -> list[float]:
        return [r for _, b in self.groups for r in b.rewards.values()]


class Training:
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
        self.queue = MicroStepQueue(groups_per_step, staleness)
        self.queue.version = version
        self.staleness, self.trajectory, self.max_tokens = staleness, trajectory, max_tokens
        self.replicas = replicas
        """A training cell's data-parallel replicas: each group makes at least this many micro-batches."""
        self.steps: dict[int, StepRecord] = {}
        self.train_tok_s = train_tok_s
        """Training throughput of one cell, tokens/s: the configured guess until a step measures it."""
        self.uncheckpointed: list[StepRecord] = []
        self.weights = weights
        """The newest published weights."""

    @property
    def version(self) -> int:
        return self.queue.version

    @property
    def optimizing(self) -> bool:
        """The current step's batch is complete and the core is finishing it."""
        rec = self.steps.get(self.version)
        return rec is not None and rec.ended

    def _record(self, step: int) -> StepRecord:
        return self.steps.setdefault(step, StepRecord(step))

    def add_group(self, group: Group) -> GroupBatch:
        """Turn a ready group into micro-batches of its step (excluded as a whole if nothing trains)."""
        batch = make_group_batch(
            [(ex.records_path, ex.evaluation) for ex in group.executions],
            group.step,
            self.staleness,
            self.trajectory,
            self.max_tokens,
            self.replicas,
        )
        group.batched = True
        rec = self._record(group.step)
        rec.groups.append((group, batch))
        tokens = sum(b.num_tokens for b in batch.micro_batches)
        if tokens:
            ms = self.queue.add_ready(group.step, group.index, batch.min_version, tokens)
            rec.micro[group.index] = (ms, len(batch.micro_batches))
        else:
            self.queue.exclude(group.step, group.index)
        return batch

    def to_send(self) -> list:
        """Messages for the core now (it must be in TRAIN): new micro-batches of the current step,
        then EndStep once every group of the step is accounted for."""
        rec, out = self._record(self.version), []
        for group, batch in rec.groups:
            if group.index not in rec.sent and batch.micro_batches:
                out.append(MicroBatches(rec.step, group.index, batch.micro_batches))
                rec.sent.add(group.index)
        if not rec.ended and self.queue.batch_ready():
            out.append(EndStep(rec.step))
            rec.ended = True
        return out

    def on_progress(self, msg: StepProgress) -> None:
        """Groups whose micro-batches are all trained leave the ready work."""
        rec = self.steps.get(msg.step)
        if rec is None:
            return
        done = {tuple(i) for i in msg.done}
        for gi, (_, n) in list(rec.micro.items()):
            if all((msg.step, gi, k) in done for k in range(n)):
                self._complete(rec, gi)

    def _complete(self, rec: StepRecord, group_index: int) -> None:
        ms, _ = rec.micro.pop(group_index, (None, 0))
        if ms is not None:
            claimed = self.queue.claim("core", index=ms.index)
            self.queue.complete(claimed)

    def on_step_done(self, msg: StepDone, num_train_cells: int) -> StepRecord:
        rec = self.steps.pop(msg.step)
        rec.metrics, rec.seconds = msg.metrics, msg.seconds
        for gi in list(rec.micro):
            self._complete(rec, gi)
        self.queue.apply_optimizer_step()
        if msg.version != self.version:
            raise RuntimeError(f"core reports version {msg.version}, the queue is at {self.version}")
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
