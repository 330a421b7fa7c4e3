"""Core and satellite cells computing one optimizer step together, while the step's batches stream in.

    core cell (owns optimizer state)                         satellite cell
    ------------------------------------------------         ---------------------------------
    weights [N] fp32, registered  <── Mooncake read ──────  pull when the step's version is new
    grad slots [K, N], registered <── Mooncake write ─────  write the micro-step's flat gradient
    control Listener (gyre/control) <── Join/Claim/Done ─>  Claim -> Work(index, version, slot, batch)
    begin_step / add_micro_batch (any thread) / end_step(total_weight)
    run_step: compute micro-steps too, fold finished slots in index order, then one optimizer step

Bytes move over the Mooncake Transfer Engine in both directions (P2P handshake; TCP here, RDMA on
clusters): one-sided reads and writes into registered memory need no collective communicator, so
a cell can join or leave between micro-steps without rebuilding anything, and a dead cell cannot
stall a collective. Control messages (gyre/control/messages.py) go over a `Channel`; a closed
channel is how the core learns that a satellite died, and its claimed micro-step goes back to the
queue (gyre/scheduler/streaming.py) to be redone. A satellite that hangs (channel open, no result)
loses its claim after `claim_timeout_s` and gets no more work on that channel.

Micro-steps are computed with normaliser 1 and added in index order whoever computed them; the sum
is divided by the step's total loss weight before clipping, so the step does not depend on the
split (bitwise on CPU) and can start before every batch exists.

The satellite's side is gyre/train/satellite.py; the core's half of that protocol is
gyre/train/core_door.py. Weights never change while anybody reads them: the
core applies its optimizer step only after every micro-step is folded (so a satellite holding a
claim may pull), and defers it while an announced pull (`Pull` ... `PullDone`) or a publish for
engines is copying them. One slot per claim keeps the core's memory bounded (`num_grad_slots`); a
freed slot goes to the back of the queue so a late write of a dead satellite cannot land in a slot
that is being reused at once."""

import logging
import threading
import time
from collections import Counter, deque

import torch

from gyre.control import messages as m
from gyre.control.transport import Channel, Listener, listen
from gyre.errors import GyreError
from gyre.scheduler.streaming import MicroStepQueue
from gyre.train.batch import BatchError
from gyre.train.core_door import CORE, SatelliteDoor
from gyre.train.loss import finish_stats, merge_stats
from gyre.train.ranks import CellRanks, engine_weights
from gyre.train.shard import core_apply, core_close, core_compute, core_fold, core_open, core_reset, skip_step
from gyre.train.trainer import Trainer, prepare_step
from gyre.trajectory.sample import PackedBatch
from gyre.transfer import BufferLayout, TransferEndpoint

logger = logging.getLogger(__name__)


class ElasticError(GyreError):
    """The core and a satellite cannot work together (mismatched model, lost core, misuse of the step API)."""


class _Step:
    """The open step, the one place its micro-batches are tracked: their ids, where their gradients
    are, and who computed what."""

    def __init__(self, version: int):
        self.version = version
        self.batches: dict[int, PackedBatch] = {}
        self.ids: dict[int, m.MicroBatchId] = {}  # index -> the id the coordinator gave it
        self.screened: list[m.MicroBatchId] = []  # nothing trainable in them: done as they arrive
        self.micro: dict[int, object] = {}  # index -> the queue's MicroStep
        self.slot_of: dict[int, int] = {}
        self.owner: dict[int, int] = {}  # index -> the data-parallel replica whose ranks hold its gradient
        self.stats: dict[int, dict] = {}
        self.timing: dict[int, tuple[str, float, float, int]] = {}  # index -> (cell, seconds, ended, rank)
        self.excluded: Counter = Counter()
        self.screened_weight = 0.0
        self.total_weight: float | None = None
        self.folded = 0
        self.running = False  # run_step is computing it
        self.aborted = False


class CoreServer(SatelliteDoor):
    """The core cell's side: hands out micro-steps as they arrive, folds them, steps once; publishes weights.

    A core of several ranks (`ranks`, driven from rank 0) computes micro-steps on its data-parallel
    replicas and folds every rank's slots in index order (gyre/train/shard.py); satellites of the
    same layout pull from and write to the core rank of their own rank.

    Args:
        host: interface the control listener and the follower ranks' Mooncake endpoints bind (a
            routable address when cells are on other nodes).
        listener: a ready listener (e.g. `listen("mpi", port_file=...)`); default TCP on `host`.
        ranks: the cell's ranks (gyre/train/ranks.py); default this one rank.
    """

    def __init__(
        self,
        trainer: Trainer,
        endpoint: TransferEndpoint,
        host: str = "127.0.0.1",
        listener: Listener | None = None,
        ranks: CellRanks | None = None,
    ):
        self.ranks = ranks or CellRanks(trainer)
        self.trainer, self.endpoint = trainer, endpoint
        self.ranks.state.endpoint = endpoint
        self._peers = self.ranks.run(core_open, host, trainer.cfg.num_grad_slots)
        """Each rank's (Mooncake session, weights address, slots address), by rank."""
        self.slots = self.ranks.state.slots
        self._num_replicas = self.ranks.num_ranks // trainer.cfg.tensor_parallel_size
        self._cond = threading.Condition()
        self._free = deque(range(trainer.cfg.num_grad_slots))
        self._queue = MicroStepQueue(groups_per_step=None, staleness=0)
        self._step: _Step | None = None
        self._readers: Counter = Counter()  # who is copying the weights now (cell pulls, "publish")
        self._pull_started: dict[str, float] = {}
        self._applying = False
        self._cells: dict[str, Channel] = {}
        self._channels: set[Channel] = set()
        self._evicted: set[str] = set()
        self._quarantine: dict[str, list[int]] = {}  # slots an evicted (hung) cell may still write
        self._published: deque = deque(maxlen=2)  # (version, descriptor, buffer) of the last two versions
        self._listener = listener or listen("tcp", host)
        self._threads = [threading.Thread(target=self._accept_loop, daemon=True, name="core-accept")]
        self._threads[0].start()

    @property
    def address(self) -> str:
        """What a satellite needs to join (gyre.control.transport.connect)."""
        return self._listener.address

    def progress(self) -> tuple[dict[int, str], dict[int, str]]:
        """Snapshot of the open step: (micro-step -> cell computing it, micro-step -> cell that did it)."""
        with self._cond:
            return self._queue.claims(), self._queue.done_by()

    def done_ids(self) -> list[m.MicroBatchId]:
        """Ids of the open step's micro-batches trained or screened out so far (empty: no step open)."""
        with self._cond:
            step = self._step
            if step is None:
                return []
            return step.screened + [step.ids[i] for i in sorted(self._queue.done_by())]

    # ---- the streaming step API ------------------------------------------------------------
    def begin_step(self, step: int | None = None) -> None:
        """Open the step at version `trainer.step` (which must be `step` if given): satellites may
        claim micro-batches as they arrive."""
        with self._cond:
            if self._step is not None:
                raise ElasticError(f"step {self._step.version} is still open; run_step must finish it first")
            if step is not None and step != self.trainer.step:
                raise ElasticError(f"step {step} cannot open: the core is at step {self.trainer.step}")
            self._queue.version = self.trainer.step
            self._step = _Step(self.trainer.step)
            self._cond.notify_all()

    def add_micro_batch(self, batch: PackedBatch, batch_id: m.MicroBatchId | None = None) -> int:
        """Screen `batch` and make it claimable (thread-safe); returns its index in the step.

        Args:
            batch_id: its id (default: (step, 0, index)); `done_ids` reports it once trained.
        Raises:
            BatchError: structurally broken, or nothing trainable left after screening (it then
                counts as done: the step goes on without it).
            ElasticError: no step is open, or end_step was already called.
        """
        try:
            (kept,), weight, excluded = prepare_step([batch], self.trainer.model_cfg.vocab_size)
        except BatchError:
            with self._cond:
                step = self._open_step("add_micro_batch")
                step.screened.append(batch_id or (step.version, 0, len(step.batches) + len(step.screened)))
            raise
        with self._cond:
            step = self._open_step("add_micro_batch")
            index = len(step.batches)
            step.ids[index] = batch_id or (step.version, 0, index + len(step.screened))
            step.batches[index] = kept
            step.micro[index] = self._queue.add_ready(step.version, index, step.version, max(kept.num_tokens, 1))
            step.screened_weight += weight
            step.excluded.update(excluded)
            self._cond.notify_all()
        return index

    def end_step(self, total_weight: float | None = None) -> None:
        """No more micro-batches this step. `total_weight` is the normaliser (summed loss weight of
        the step's targets); None uses the weight of what was screened in, as `Trainer.train_step` does.
        A step with nothing to train (every micro-batch screened out, or none) is skipped: run_step
        moves the version on and leaves the weights as they are."""
        with self._cond:
            step = self._open_step("end_step")
            if not step.batches:
                step.total_weight = 0.0
                self._queue.close_step(step.version)
                self._cond.notify_all()
                return
            weight = step.screened_weight if total_weight is None else float(total_weight)
            if not weight > 0:
                raise ElasticError(f"end_step: the step's total loss weight must be > 0, got {weight}")
            step.total_weight = weight
            self._queue.close_step(step.version)
            self._cond.notify_all()

    def abort_step(self) -> None:
        """Drop the open step without an optimizer step (a running run_step raises ElasticError)."""
        with self._cond:
            step = self._step
            if step is None:
                return
            step.aborted = True
            self._cond.notify_all()
            if not step.running:
                self._finish(step, applied=False)

    def _open_step(self, what: str) -> _Step:
        if self._step is None:
            raise ElasticError(f"{what}: no step is open; call begin_step first")
        if self._step.total_weight is not None:
            raise ElasticError(f"{what}: step {self._step.version} was already ended")
        return self._step

    def run_step(self) -> dict:
        """Compute the open step with whichever cells are connected; blocks until its optimizer step.

        Returns:
            Loss metrics, grad norm, `microsteps_by/<cell>`, `microsteps_redone`, exclusions, and
            `microsteps`: [(id, cell, seconds, unix time it ended, tokens, rank of the cell that
            computed it)] per micro-step in index order; `{"skipped": 1}` for a step with nothing to train.
        Raises:
            ElasticError: no step is open, or it was aborted (abort_step).
        """
        with self._cond:
            if self._step is None or self._step.running:
                raise ElasticError("run_step: no step is open (call begin_step first) or it is running already")
            step = self._step
            step.running = True
        redone_before = self._queue.num_redone
        applied = False
        try:
            self.ranks.run(core_reset)  # an aborted step may have left a partial sum
            while (work := self._next_core_work(step)) is not None:
                self._fold_on_ranks(work[1]) if work[0] == "fold" else self._compute_on_core(step, work[1])
            with self._cond:
                while self._readers:  # an announced pull or a publish is copying the weights
                    self._evict_hung_pulls()
                    self._cond.wait(timeout=0.05 if self.trainer.cfg.claim_timeout_s else None)
                self._applying = True
            if not step.batches:
                self.ranks.run(skip_step)
                applied = True
                return {"skipped": 1}
            metrics = self.ranks.run(core_apply, step.total_weight)
            applied = True
        finally:
            self._finish(step, applied)
        stats = {}
        for i in range(len(step.batches)):
            stats = merge_stats(stats, step.stats[i])
        timing = []
        for i in range(len(step.batches)):
            cell, seconds, ended, rank = step.timing[i]
            timing.append((step.ids[i], cell, seconds, ended, step.batches[i].num_tokens, rank))
        by_cell = Counter(f"microsteps_by/{t[1]}" for t in timing)
        return (
            finish_stats(stats)
            | dict(step.excluded)
            | dict(by_cell)
            | metrics
            | {"microsteps_redone": self._queue.num_redone - redone_before, "microsteps": timing}
        )

    def _finish(self, step: _Step, applied: bool) -> None:
        with self._cond:
            self._applying = False
            self._step = None
            if applied:
                self._queue.apply_optimizer_step()
            else:  # an error: drop the step; satellites' late results are refused (no claim matches)
                claims = self._queue.claims()
                self._queue = MicroStepQueue(groups_per_step=None, staleness=0)
                for index, slot in step.slot_of.items():  # in-flight claims keep their slot quarantined
                    cell = claims.get(index, CORE)
                    (self._free if cell == CORE else self._quarantine.setdefault(cell, [])).append(slot)
            self._cond.notify_all()

    def _next_core_work(self, step: _Step) -> tuple[str, list] | None:
        """What the core's ranks do next: ("fold", [(slot, owner replica)]) for finished slots in
        index order, ("compute", [(micro-step, slot)]) one per data-parallel replica, or None when
        the step is folded whole.

        The core also takes the next micro-step to fold when no slot is free (even with
        core_computes_microsteps off): it adds that one straight into the sum (slot None), so slots
        held by later results or quarantined by a hung cell can never stall the step.
        """
        cfg = self.trainer.cfg
        with self._cond:
            while True:
                if entries := self._foldable(step):
                    return "fold", entries
                if step.aborted:
                    raise ElasticError(f"step {step.version} was aborted")
                if step.total_weight is not None and step.folded == len(step.batches):
                    return None
                self._evict_overdue(step)
                now, jobs = time.monotonic(), []
                while cfg.core_computes_microsteps and len(jobs) < self._num_replicas and self._free:
                    if (ms := self._queue.claim(CORE, now)) is None:
                        break
                    step.slot_of[ms.index] = slot = self._free.popleft()
                    jobs.append((ms, slot))
                if jobs:
                    return "compute", jobs
                if not self._free and (ms := self._queue.claim(CORE, now, index=step.folded)) is not None:
                    return "compute", [(ms, None)]
                self._cond.wait(timeout=0.05 if cfg.claim_timeout_s else 1.0)

    def _evict_overdue(self, step: _Step) -> None:
        """Take micro-steps back from cells that hold one past `claim_timeout_s` (hung, not dead).

        Their slots stay quarantined until their channel closes (the process is gone): a hung
        process that wakes up could still write into them.
        """
        timeout = self.trainer.cfg.claim_timeout_s
        if not timeout:
            return
        for cell in self._queue.overdue(time.monotonic(), timeout) - {CORE}:
            self._evicted.add(cell)
            lost = [ms.index for ms in self._queue.release(cell)]
            self._quarantine.setdefault(cell, []).extend(step.slot_of.pop(i) for i in lost)
            logger.warning("satellite %s held micro-steps %s over %.1f s: redoing them elsewhere", cell, lost, timeout)

    def _evict_hung_pulls(self) -> None:
        """A cell whose announced pull lasts past `claim_timeout_s` is presumed hung: the step goes on
        without waiting for it, and it gets no more work on this channel (its next claim is
        answered Evicted, which makes it pull again after rejoining)."""
        timeout, now = self.trainer.cfg.claim_timeout_s, time.monotonic()
        for cell in [c for c in self._readers if c != "publish"] if timeout else []:
            if now - self._pull_started.get(cell, now) > timeout:
                del self._readers[cell]
                self._evicted.add(cell)
                logger.warning("satellite %s held a weight pull over %.1f s: stepping without it", cell, timeout)

    def _foldable(self, step: _Step) -> list[tuple[int, int]]:
        """Take the next finished micro-steps in index order: [(slot, owner replica)]."""
        done, entries = self._queue.done_by(), []
        while step.folded in done and step.folded in step.slot_of:
            entries.append((step.slot_of.pop(step.folded), step.owner.pop(step.folded)))
            step.folded += 1
        return entries

    def _fold_on_ranks(self, entries: list[tuple[int, int]]) -> None:
        self.ranks.run(core_fold, entries)
        with self._cond:
            self._free.extend(slot for slot, _ in entries)  # free once added, never before
            self._cond.notify_all()

    def _compute_on_core(self, step: _Step, jobs: list[tuple]) -> None:
        results = self.ranks.run(core_compute, [(step.batches[ms.index], slot) for ms, slot in jobs])
        direct = jobs[0][1] is None  # the next micro-step to fold: every earlier one is in the sum already
        if direct:
            self.ranks.run(core_fold, [(None, 0)])
        with self._cond:
            for replica, (ms, _) in enumerate(jobs):
                stats, seconds, ended, rank = results[replica]
                self._queue.complete(ms, CORE)
                step.stats[ms.index] = stats
                step.owner[ms.index] = replica
                step.timing[ms.index] = (CORE, seconds, ended, rank)
            step.folded += direct
            self._cond.notify_all()

    # ---- weights for engines ---------------------------------------------------------------
    def publish(self) -> tuple[int, dict]:
        """(version, descriptor) of the engine-format buffer of the current weights (copied once per
        version). The previous version's buffer stays readable too, so an engine that was handed
        it a moment ago still loads it whole."""
        with self._cond:
            while self._applying:
                self._cond.wait()
            version = self.trainer.step
            if self._published and self._published[-1][0] == version:
                return version, self._published[-1][1]
            self._readers["publish"] += 1
        try:
            descriptor, buffer = self.endpoint.publish_tensors(self.ranks.run(engine_weights))
        finally:
            with self._cond:
                self._readers["publish"] -= 1
                self._readers += Counter()  # drop zero counts
                self._cond.notify_all()
        if len(self._published) == self._published.maxlen:
            self.endpoint.unregister(self._published[0][2])
        self._published.append((version, descriptor, buffer))
        return version, descriptor

    def published_tensors(self, version: int) -> dict[str, torch.Tensor]:
        """Engine-named views of the published snapshot of `version` (read-only for the caller).

        Raises:
            KeyError: `version` is no longer (or not yet) published.
        """
        for v, descriptor, buffer in list(self._published):
            if v == version:
                return BufferLayout.from_json(descriptor["layout"]).unpack(buffer)
        raise KeyError(f"weight version {version} is not published; have {[p[0] for p in self._published]}")

    def close(self) -> None:
        """Stop serving: satellites see their channel close and leave their loop."""
        self._listener.close()
        with self._cond:
            channels = list(self._channels)
        for ch in channels:
            ch.close()
        for t in self._threads:
            t.join(timeout=5)
        for _, _, buffer in self._published:
            self.endpoint.unregister(buffer)
        core_close(self.ranks.state)  # this rank's; the followers' go with their processes
