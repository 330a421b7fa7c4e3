"""Core and satellite cells computing one optimizer step together, while the step's batches stream in.

    core cell (owns optimizer state)                         satellite cell
    ------------------------------------------------         ---------------------------------
    weights [N] fp32, registered  <── Mooncake read ──────  pull when the step's version is new
    grad slots [K, N], registered <── Mooncake write ─────  write the micro-step's flat gradient
    control Listener (gyre/control) <── Join/Claim/Done ─>  Claim -> Work(index, version, slot, batch, replica)
    begin_step / add_micro_batch (any thread) / end_step
    run_step: compute micro-steps too, fold finished slots in index order, then one optimizer step

Bytes move over the Mooncake Transfer Engine in both directions (P2P handshake; TCP here, RDMA on
clusters): one-sided reads and writes into registered memory need no collective communicator, so
a cell can join or leave between micro-steps without rebuilding anything, and a dead cell cannot
stall a collective. Control messages (gyre/control/messages.py) go over a `Channel`; a closed
channel is how the core learns that a satellite died, and its claimed micro-step goes back to the
queue to be redone. A satellite that hangs (channel open, no result)
loses its claim after `claim_timeout_s` and gets no more work on that channel.

Micro-steps are computed with normaliser 1 and added in index order whoever computed them; the sum
is divided by the step's total loss weight before clipping, so the step does not depend on the
split (bitwise on CPU) and can start before every batch exists.

The satellite's side is gyre/train/satellite.py; the core's half of that protocol is
gyre/train/core_door.py, and the step's one ledger (a record per micro-batch, the slots, the weights'
readers) is gyre/train/core_state.py. Weights never change while anybody reads them: the
core applies its optimizer step only after every micro-step is folded (so a satellite holding a
claim may pull), and defers it while an announced pull (`Pull` ... `PullDone`) or a publish for
engines is copying them. One slot per claim keeps the core's memory bounded: each core rank holds
`num_grad_slots` rows of its shard, the slots of its data-parallel replica, so a layout of R
replicas has K x R micro-steps in flight (a satellite holds at most one claim per replica) at the
memory of K per rank. A freed slot goes to the back of the queue so a late write of a dead
satellite cannot land in a slot that is being reused at once."""

import logging
import time
from collections import Counter, deque

import torch

from gyre.control.transport import Listener, listen
from gyre.errors import GyreError
from gyre.train.batch import BatchError
from gyre.train.core_door import SatelliteDoor
from gyre.train.core_state import CORE, CoreState, MicroBatch, OpenStep
from gyre.train.loss import finish_stats, merge_stats
from gyre.train.ranks import CellRanks, engine_weights
from gyre.train.shard import core_apply, core_close, core_compute, core_fold, core_open, core_reset, skip_step
from gyre.train.trainer import Trainer, prepare_step
from gyre.trajectory.sample import PackedBatch
from gyre.transfer import BufferLayout, TransferEndpoint

logger = logging.getLogger(__name__)


class ElasticError(GyreError):
    """The core and a satellite cannot work together (mismatched model, lost core, misuse of the step API)."""


class CoreServer:
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
        peers = self.ranks.run(core_open, host, trainer.cfg.num_grad_slots)
        """Each rank's (Mooncake session, weights address, slots address), by rank."""
        self._num_replicas = self.ranks.num_ranks // trainer.cfg.tensor_parallel_size
        self.state = CoreState(trainer.cfg.num_grad_slots, trainer.step, self._num_replicas)
        self._published: deque = deque(maxlen=2)  # (version, descriptor, buffer) of the last two versions
        layout = (self.ranks.num_ranks, trainer.cfg.tensor_parallel_size)
        self.door = SatelliteDoor(self.state, listener or listen("tcp", host), peers, layout, trainer.flat.signature())

    @property
    def address(self) -> str:
        """What a satellite needs to join (gyre.control.transport.connect)."""
        return self.door.address

    def progress(self) -> tuple[dict[int, str], dict[int, str]]:
        """Snapshot of the open step: (micro-step -> cell computing it, micro-step -> cell that did it)."""
        return self.state.progress()

    def done_ids(self) -> list:
        """Ids of the open step's micro-batches trained or screened out so far (empty: no step open)."""
        with self.state.cond:
            step = self.state.step
            if step is None:
                return []
            return step.screened + [mb.id for mb in step.batches if mb.done_by is not None]

    # ---- the streaming step API ------------------------------------------------------------
    def begin_step(self, step: int | None = None) -> None:
        """Open the step at version `trainer.step` (which must be `step` if given): satellites may
        claim micro-batches as they arrive."""
        with self.state.cond:
            if self.state.step is not None:
                raise ElasticError(f"step {self.state.step.version} is still open; run_step must finish it first")
            if step is not None and step != self.trainer.step:
                raise ElasticError(f"step {step} cannot open: the core is at step {self.trainer.step}")
            self.state.step = OpenStep(self.trainer.step)
            self.state.cond.notify_all()

    def add_micro_batch(self, batch: PackedBatch, batch_id: tuple | None = None) -> int:
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
            with self.state.cond:
                step = self._open_step("add_micro_batch")
                step.screened.append(batch_id or (step.version, 0, len(step.batches) + len(step.screened)))
            raise
        with self.state.cond:
            step = self._open_step("add_micro_batch")
            index = len(step.batches)
            mb_id = batch_id or (step.version, 0, index + len(step.screened))
            step.batches.append(MicroBatch(index, mb_id, kept))
            step.ready.append(index)
            step.screened_weight += weight
            step.excluded.update(excluded)
            self.state.cond.notify_all()
        return index

    def end_step(self) -> None:
        """No more micro-batches this step. Its loss normaliser is the summed loss weight of what was
        screened in (the one normaliser, as `Trainer.train_step` uses it). A step with nothing to
        train (every micro-batch screened out, or none) is skipped: run_step moves the version on
        and leaves the weights as they are."""
        with self.state.cond:
            step = self._open_step("end_step")
            step.total_weight = step.screened_weight if step.batches else 0.0
            self.state.cond.notify_all()

    def abort_step(self) -> None:
        """Drop the open step without an optimizer step (a running run_step raises ElasticError)."""
        with self.state.cond:
            step = self.state.step
            if step is None:
                return
            step.aborted = True
            self.state.cond.notify_all()
            if not step.running:
                self.state.finish(step, applied=False, version=self.trainer.step)

    def _open_step(self, what: str) -> OpenStep:
        step = self.state.step
        if step is None:
            raise ElasticError(f"{what}: no step is open; call begin_step first")
        if step.total_weight is not None:
            raise ElasticError(f"{what}: step {step.version} was already ended")
        return step

    def run_step(self) -> dict:
        """Compute the open step with whichever cells are connected; blocks until its optimizer step.

        Returns:
            Loss metrics, grad norm, `microsteps_by/<cell>`, `microsteps_redone`, exclusions, and
            `microsteps`: [(id, cell, seconds, unix time it ended, tokens, rank of the cell that
            computed it)] per micro-step in index order; `{"skipped": 1}` for a step with nothing to train.
        Raises:
            ElasticError: no step is open, or it was aborted (abort_step).
        """
        with self.state.cond:
            step = self.state.step
            if step is None or step.running:
                raise ElasticError("run_step: no step is open (call begin_step first) or it is running already")
            step.running = True
        applied = False
        try:
            self.ranks.run(core_reset)  # an aborted step may have left a partial sum
            while (work := self._next_core_work(step)) is not None:
                self._fold_on_ranks(work[1]) if work[0] == "fold" else self._compute_on_core(step, work[1])
            self._wait_for_readers()
            if not step.batches:
                self.ranks.run(skip_step)
                applied = True
                return {"skipped": 1}
            metrics = self.ranks.run(core_apply, step.total_weight)
            applied = True
        finally:
            self.state.finish(step, applied, self.trainer.step)
        return _step_metrics(step) | metrics

    def _wait_for_readers(self) -> None:
        """Until nobody copies the weights (an announced pull, a publish); then the optimizer step may run."""
        timeout = self.trainer.cfg.claim_timeout_s
        with self.state.cond:
            while self.state.readers:
                for cell in self.state.evict_hung_pulls(timeout):
                    logger.warning("satellite %s held a weight pull over %.1f s: stepping without it", cell, timeout)
                self.state.cond.wait(timeout=0.05 if timeout else None)
            self.state.applying = True

    def _next_core_work(self, step: OpenStep) -> tuple[str, list] | None:
        """What the core's ranks do next: ("fold", [micro-batch]) for finished ones in index order,
        ("compute", [micro-batch or None]) by data-parallel replica (each with a slot of its own),
        or None when the step is folded whole.

        The core also takes the next micro-batch to fold when no slot is free (even with
        core_computes_microsteps off): it adds that one straight into the sum (slot None), so slots
        held by later results or quarantined by a hung cell can never stall the step.
        """
        cfg, state = self.trainer.cfg, self.state
        with state.cond:
            while True:
                if entries := step.foldable():
                    return "fold", entries
                if step.aborted:
                    raise ElasticError(f"step {step.version} was aborted")
                if step.complete_whole:
                    return None
                for cell, lost in state.evict_overdue(cfg.claim_timeout_s).items():
                    logger.warning(
                        "satellite %s held micro-steps %s over %.1f s: redoing them elsewhere",
                        cell,
                        lost,
                        cfg.claim_timeout_s,
                    )
                replicas = range(self._num_replicas) if cfg.core_computes_microsteps else ()
                jobs = [state.claim_slot(CORE, {replica}) for replica in replicas]
                if any(jobs):
                    return "compute", jobs
                if not state.free and (mb := step.claim(CORE, time.monotonic(), index=step.folded)) is not None:
                    return "compute", [mb]  # replica 0's; its slot stays None: added straight into the sum
                state.cond.wait(timeout=0.05 if cfg.claim_timeout_s else 1.0)

    def _fold_on_ranks(self, batches: list[MicroBatch]) -> None:
        slots = [(mb.replica, mb.slot) for mb in batches]
        self.ranks.run(core_fold, [(mb.slot, mb.replica) for mb in batches])
        with self.state.cond:
            for mb in batches:
                mb.slot = None
            self.state.free.extend(slots)  # free once added, never before
            self.state.cond.notify_all()

    def _compute_on_core(self, step: OpenStep, jobs: list[MicroBatch | None]) -> None:
        results = self.ranks.run(core_compute, [(mb.batch, mb.slot) if mb else None for mb in jobs])
        direct = jobs[0] is not None and jobs[0].slot is None  # the next to fold: all before it are summed
        if direct:
            self.ranks.run(core_fold, [(None, 0)])
        with self.state.cond:
            for replica, mb in enumerate(jobs):
                if mb is None:
                    continue
                stats, seconds, ended, rank = results[replica]
                step.complete(mb, CORE)
                mb.stats, mb.replica, mb.timing = stats, replica, (seconds, ended, rank)
            step.folded += direct
            self.state.cond.notify_all()

    # ---- weights for engines ---------------------------------------------------------------
    def publish(self) -> tuple[int, dict]:
        """(version, descriptor) of the engine-format buffer of the current weights (copied once per
        version). The previous version's buffer stays readable too, so an engine that was handed
        it a moment ago still loads it whole."""
        state = self.state
        with state.cond:
            while state.applying:
                state.cond.wait()
            version = self.trainer.step
            if self._published and self._published[-1][0] == version:
                return version, self._published[-1][1]
            state.readers["publish"] += 1
        try:
            descriptor, buffer = self.endpoint.publish_tensors(self.ranks.run(engine_weights))
        finally:
            state.end_pull("publish")
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
        self.door.close()
        for _, _, buffer in self._published:
            self.endpoint.unregister(buffer)
        core_close(self.ranks.state)  # this rank's; the followers' go with their processes


def _step_metrics(step: OpenStep) -> dict:
    """A step's loss statistics, exclusions and who computed each micro-batch, in index order."""
    stats = {}
    for mb in step.batches:
        stats = merge_stats(stats, mb.stats)
    timing = [(mb.id, mb.done_by, *mb.timing[:2], mb.batch.num_tokens, mb.timing[2]) for mb in step.batches]
    by_cell = Counter(f"microsteps_by/{t[1]}" for t in timing)
    return (
        finish_stats(stats)
        | dict(step.excluded)
        | dict(by_cell)
        | {"microsteps_redone": step.redone, "microsteps_in_flight_max": step.peak_in_flight, "microsteps": timing}
    )
