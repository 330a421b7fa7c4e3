"""The training side of the run: ready groups become the step's micro-batches, the core steps once.

    group ready ─> make_group_batch ─> MicroStepQueue[step] ─(batch ready, core in TRAIN)─> TrainStep
    StepDone ─> version + 1 ─> engines of serving cells load it ─> checkpoint ─> ledger: trained

Executions are written to the ledger as trained only once the checkpoint that holds their step
is complete, so a resume never loses one and never trains one twice.
"""

import logging
from dataclasses import dataclass, field

from gyre.cells.protocol import CheckpointDone, SaveCheckpoint, StepDone, TrainStep
from gyre.coordinator.batching import GroupBatch, make_group_batch
from gyre.coordinator.rollouts import Group
from gyre.scheduler.streaming import MicroStepQueue
from gyre.trajectory.config import TrajectoryConfig

log = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """What one optimizer step trained and how it went (for events, the summary, the ledger)."""

    step: int
    groups: list[tuple[Group, GroupBatch]] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def rewards(self) -> list[float]:
        return [r for _, b in self.groups for r in b.rewards.values()]


class Training:
    def __init__(self, *, groups_per_step: int, staleness: int, trajectory: TrajectoryConfig, max_tokens: int,
                 version: int, train_tok_s: float, weights: dict | None = None):  # fmt: skip
        self.queue = MicroStepQueue(groups_per_step, staleness)
        self.queue.version = version
        self.staleness, self.trajectory, self.max_tokens = staleness, trajectory, max_tokens
        self.steps: dict[int, StepRecord] = {}
        self.in_flight: StepRecord | None = None
        self.train_tok_s = train_tok_s
        """Training throughput of one cell, tokens/s: the configured guess until a step measures it."""
        self.uncheckpointed: list[StepRecord] = []
        self.weights = weights
        """The newest published weights (descriptor + version)."""
        self._claimed: list = []

    @property
    def version(self) -> int:
        return self.queue.version

    def add_group(self, group: Group) -> GroupBatch:
        """Turn a ready group into micro-batches of its step (excluded as a whole if nothing trains)."""
        batch = make_group_batch([(ex.records_path, ex.evaluation) for ex in group.executions], group.step,
                                 self.staleness, self.trajectory, self.max_tokens)
        group.batched = True
        self.steps.setdefault(group.step, StepRecord(group.step)).groups.append((group, batch))
        tokens = sum(b.num_tokens for b in batch.micro_batches)
        if tokens:
            self.queue.add_ready(group.step, group.index, batch.min_version, tokens)
        else:
            self.queue.exclude(group.step, group.index)
        return batch

    def next_step(self) -> TrainStep | None:
        """The current step's TrainStep once its batch is complete and no step is running."""
        if self.in_flight is not None or not self.queue.batch_ready():
            return None
        rec = self.steps.setdefault(self.version, StepRecord(self.version))
        self._claimed = []
        while (ms := self.queue.claim()) is not None:
            self._claimed.append(ms)
        batches = [mb for _, b in rec.groups for mb in b.micro_batches]
        self.in_flight = rec
        return TrainStep(rec.step, batches, sum(b.total_weight for _, b in rec.groups))

    def on_step_done(self, msg: StepDone, num_train_cells: int) -> StepRecord:
        rec, self.in_flight = self.in_flight, None
        rec.metrics, rec.seconds = msg.metrics, msg.seconds
        for ms in self._claimed:
            self.queue.complete(ms)
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
