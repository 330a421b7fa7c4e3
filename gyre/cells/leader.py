"""A cell leader: one process per cell that owns the cell's engine and trainer and switches roles.

    coordinator ──RoleSwitch──> leader ──(proxy admin, engine HTTP, core channel)──> PhaseDone... RoleDone
                MicroBatches ──> core leader: add_micro_batch (run_step runs in a worker thread)
                     EndStep ──> ... ──StepProgress... ──> publish ──> StepDone

A local cell is this process (the trainer's rank 0: the core's owns optimizer and weights; a
satellite's pulls weights and pushes gradients over Mooncake), its other ranks, and its engine
children, one per node or per engine.tp_size ranks (gyre.cells.serving; `engine.backend`: what
differs between backends in a switch is the engine process's `release`/`resume`). On Slurm the
engines of the cell's other nodes are their first ranks' children; the leader drives them by URL
like its own. All stay warm: a
switch moves work, not processes. Each of its phases (gyre.scheduler.cells.PHASES) runs on every
engine at once and is timed per rank and reported. The leader exits when its coordinator's channel
closes, stopping its engines.

    python -m gyre.cells.leader SPEC_FILE        (gyre.cells.spec.CellSpec as JSON, a private file)
"""

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

from gyre.cells.base import CellError
from gyre.cells.serving import (
    cell_phase_s,
    engine_id,
    plan_engines,
    ranks_from_engines,
    ranks_from_work,
    started_by,
)
from gyre.cells.spec import CellSpec
from gyre.common.ports import PortReservation
from gyre.common.run_paths import RunPaths
from gyre.common.serve import exit_at_once, first_exited
from gyre.control.messages import (
    CellReady,
    CheckpointDone,
    EndStep,
    Failure,
    MicroBatches,
    PhaseDone,
    RoleDone,
    RoleSwitch,
    SaveCheckpoint,
    StepDone,
    StepProgress,
    Stop,
)
from gyre.control.transport import ChannelClosed, ChannelTimeout, connect
from gyre.engines.published import PublishedWeights
from gyre.engines.weights import serve_weights
from gyre.metrics.events import MicroStepEvent
from gyre.metrics.log import EventLog
from gyre.scheduler.cells import PHASES, Phase, Role

log = logging.getLogger("gyre.cells.leader")
RANK_LOST_EXIT = 75
"""The leader's exit code when one of its cell's other ranks died."""
ENGINE_LOST_EXIT = 76
"""The leader's exit code when an engine it started exited."""
ENGINE_PHASES = (
    Phase.STOP_ADMISSION,
    Phase.HAND_OFF_SESSIONS,
    Phase.RELEASE_ENGINE_MEMORY,
    Phase.LOAD_WEIGHTS,
    Phase.ANNOUNCE_TO_PROXY,
)
"""The phases every engine of the cell goes through (side by side); the others are the trainer's."""


class CellLeader:
    def __init__(self, spec: CellSpec):
        import torch

        from gyre.train.ranks import CellRanks
        from gyre.train.trainer import Trainer
        from gyre.transfer import TransferEndpoint

        torch.set_num_threads(1)
        self.spec = spec
        self.index, self.is_core = spec.index, spec.index == 0
        self.channel = None
        """Connected once the cell is built (`run`): the coordinator accepts leaders one handshake at a time,
        so connecting first would make every cell wait for the previous one to be built."""
        self.events = EventLog(spec.run_dir)
        e = spec.engine
        self.slots = plan_engines(spec.ranks, spec.nodes, e.tp_size, e.on_gpu, nnodes=e.nnodes)
        self.engine_ids = [engine_id(self.index, slot.index) for slot in self.slots]
        self.engines = []
        self._closing = threading.Event()
        self.followers = []
        """Ranks 1.. of this cell (gyre/train/ranks.py); this process is rank 0, the cell's control endpoint."""
        # The trainer first: a satellite, which serves first, moves its state off the device before
        # its engines start and size their memory to what is free (gyre.train.trainer.Trainer.offload).
        spawning = spec.ranks > 1 and not spec.followers_placed
        with PortReservation() if spawning else contextlib.nullcontext() as master_port:  # until the group binds it
            if spawning:
                from gyre.train.ranks import start_followers

                args = (spec.ranks, spec.host, master_port, spec.model, spec.trainer, spec.seed, spec.run_dir)
                self.followers = start_followers(*args)
            self.trainer = Trainer(spec.model, spec.trainer, seed=spec.seed)
        link_host = spec.host if spec.followers_placed else None  # srun's tasks: not this process's children
        self.ranks = CellRanks(self.trainer, self.followers, self._rank_lost, link_host=link_host)
        if not self.is_core:
            self._move_trainer(Phase.OFFLOAD_TRAINER)
        # Slurm: this node's engines; the other nodes' first ranks start theirs (`_attach_engines`)
        self.engines = _start_engines(spec, started_by(self.slots, 0) if spec.followers_placed else self.slots)
        threading.Thread(target=self._watch_engines, args=(list(self.engines),), daemon=True).start()
        if len(self.engines) < len(self.slots):
            self._attach_engines()
        self.endpoint = TransferEndpoint(spec.host)
        self.role = Role(spec.role)
        self.weights: PublishedWeights | None = None
        """The newest published weights: what its engines load when the cell next serves (the
        version they serve is the proxy's to keep, gyre.engines.weights.serve_weights)."""
        self.core_address = ""
        self._worker: threading.Thread | None = None
        self._stop = threading.Event()
        self.core = self.satellite = self.publisher = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"cell{self.index}-step")
        self._run: tuple[int, float, Future] | None = None
        """The core's open step as this leader drives it: (step, when it opened, run_step's future);
        the step's micro-batches are the core's to track (CoreServer.done_ids)."""
        self._num_reported = 0
        """How many of the open step's ids (CoreServer.done_ids) StepProgress has reported."""
        if self.is_core:
            self._start_core()

    def _start_core(self) -> None:
        """The core's trainer side: its ranks, initial weights, satellite listener and publisher."""
        from gyre.control.transport import listen
        from gyre.train.elastic import CoreServer
        from gyre.train.publish import WeightPublisher

        spec = self.spec
        self._load_initial_weights()
        listener = listen(
            spec.control,
            spec.host,
            port_file=str(RunPaths(spec.run_dir).core_port(os.getpid())),
            peer_timeout_s=spec.control_peer_timeout_s,
        )
        self.core = CoreServer(self.trainer, self.endpoint, spec.host, listener=listener, ranks=self.ranks)
        self.publisher = WeightPublisher(
            self.core,
            spec.engine.weight_sync,
            spec.model,
            str(RunPaths(spec.run_dir).weights),
            spec.host,
            spec.engine.tp_size,
        )
        self.weights = self.publisher.publish()

    def _rank_lost(self, rank: int, code: int) -> None:
        """A follower rank exited: the cell is lost (a satellite: the run goes on without it; the
        core: the run stops and resumes from its checkpoint). Exit at once, whatever the leader's
        threads wait on (a collective with the dead rank may never return): the coordinator sees
        this process gone, and the other ranks and engines die with it (PR_SET_PDEATHSIG)."""
        log.error("cell %d: rank %d exited with code %s; the cell is lost", self.index, rank, code)
        self._exit_lost(RANK_LOST_EXIT)

    def _exit_lost(self, code: int) -> None:
        """Exit at once with `code`; the engines' files go first (they die after us, unstopped)."""
        for engine in self.engines:
            engine.remove_files()
        exit_at_once(code)

    def _watch_engines(self, engines: list) -> None:
        """An engine this process started that exits loses the cell, as a rank's death does (a
        follower watches its node's the same way, gyre.cells.slurm); found within half a second,
        not at the next switch or weight load that would fail on it."""
        if (engine := first_exited(engines, self._closing)) is not None:
            code, tail = engine.proc.returncode, engine.log_tail(1000)
            log.error(
                "cell %d: its engine %s exited with code %s; the cell is lost. Its log's tail:\n%s",
                self.index,
                engine.url,
                code,
                tail,
            )
            self._exit_lost(ENGINE_LOST_EXIT)

    # ---- start ---------------------------------------------------------------------------
    def _attach_engines(self) -> None:
        """Add the engines the followers started (Slurm: each node's first rank, its node's), in
        slot order: the nodes' first ranks come in the slots' node order."""
        from gyre.engines.launch import attach_engine
        from gyre.train.ranks import engine_urls

        urls = [url for rank_urls in self.ranks.run(engine_urls)[1:] for url in rank_urls]
        expected = len(self.slots) - len(self.engines)
        if len(urls) != expected:
            raise CellError(f"cell {self.index}: its other nodes started {len(urls)} engines, not {expected}")
        self.engines += [attach_engine(self.spec.engine, self.spec.model, url) for url in urls]

    def _load_initial_weights(self) -> None:
        """The latest checkpoint (resume), else the initial model directory, else the seeded init."""
        from gyre.train.ranks import load_engine_dir, load_latest

        keep = self.spec.trainer.checkpoint_keep_last
        if self.spec.resume and self.ranks.run(load_latest, self.spec.checkpoint_dir, keep) is not None:
            return
        if self.spec.init_weights:
            self.ranks.run(load_engine_dir, self.spec.init_weights)

    def weights_digest(self) -> str:
        from gyre.train import shard

        return self.ranks.run(shard.weights_digest)

    def ready(self) -> CellReady:
        urls = [engine.url for engine in self.engines]
        if not self.is_core:
            return CellReady(self.index, urls)
        return CellReady(self.index, urls, self.core.address, self.weights, self.trainer.step, self.weights_digest())

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        try:
            try:
                self.channel = connect(self.spec.coordinator_address, peer_timeout_s=self.spec.control_peer_timeout_s)
            except ChannelClosed as e:  # never connected: this cell failed, the coordinator did not stop it
                raise CellError(f"cell {self.index}: cannot reach the coordinator: {e}") from None
            self.channel.send(self.ready())
            while True:
                if self.is_core:
                    self._watch_step()
                try:
                    msg = self.channel.recv(timeout_s=0.05)
                except ChannelTimeout:
                    continue
                if isinstance(msg, Stop):
                    return
                self._handle(msg)
        except ChannelClosed as e:
            log.warning("cell %d: the coordinator's channel closed (%s); stopping", self.index, e)
        finally:
            self.close()

    def _handle(self, msg) -> None:
        try:
            if isinstance(msg, RoleSwitch):
                self._switch(Role(msg.target), msg.weights, msg.core_address)
            elif isinstance(msg, MicroBatches):
                self._add_batches(msg)
            elif isinstance(msg, EndStep):
                self._end_step(msg.step)
            elif isinstance(msg, SaveCheckpoint):
                from gyre.train.ranks import save

                t0 = time.monotonic()
                path = self.ranks.run(save, self.spec.checkpoint_dir, self.spec.trainer.checkpoint_keep_last, msg.extra)
                self.channel.send(CheckpointDone(msg.step, path, time.monotonic() - t0, self.weights_digest()))
            else:
                raise TypeError(f"unexpected message {type(msg).__name__}")
        except ChannelClosed:
            raise
        except Exception as e:  # reported, the leader keeps serving: the coordinator decides
            log.exception("cell %d failed on %s", self.index, type(msg).__name__)
            self.channel.send(Failure(self.index, f"{type(msg).__name__}: {e!r}"))

    # ---- training steps (core) -----------------------------------------------------------
    def _open(self, step: int) -> None:
        """Open `step` on the core (once) and compute it in a worker thread as its batches arrive."""
        if self._run is None:
            self.core.begin_step(step)
            self._run = (step, time.monotonic(), self._pool.submit(self.core.run_step))
            self._num_reported = 0

    def _add_batches(self, msg: MicroBatches) -> None:
        from gyre.train.batch import BatchError

        self._open(msg.step)
        for k, batch in enumerate(msg.batches):
            try:
                self.core.add_micro_batch(batch, (msg.step, msg.group, k))
            except BatchError as e:  # nothing trainable in it: the core counts it as done
                log.warning("step %d: micro-batch (group %d, %d) screened out: %s", msg.step, msg.group, k, e)

    def _end_step(self, step: int) -> None:
        self._open(step)  # a step none of whose groups had anything to train: the core skips it
        self.core.end_step()

    def _watch_step(self) -> None:
        """Report micro-batches trained so far; once run_step returned, publish and say StepDone."""
        if self._run is None:
            return
        step, t0, run = self._run
        done = self.core.done_ids()
        if len(done) > self._num_reported:
            self._num_reported = len(done)
            self.channel.send(StepProgress(step, done))
        if not run.done():
            return
        self._run = None
        if run.exception() is not None:
            self.channel.send(Failure(self.index, f"step {step}: {run.exception()!r}"))
            return
        metrics = run.result()
        for k, (_, cell, seconds, ended, tokens, rank) in enumerate(metrics.pop("microsteps", [])):
            by = 0 if cell == "core" else int(str(cell).removeprefix("cell"))
            # t is when it ended, not now: a cell's busy time is [t - seconds, t] (gyre.metrics.state)
            self.events.emit(
                MicroStepEvent(t=ended, step=step, index=k, cell=by, rank=rank, tokens=tokens, seconds=seconds)
            )
        self._done(step, metrics, time.monotonic() - t0)

    def _done(self, step: int, metrics: dict, seconds: float) -> None:
        self.weights = self.publisher.publish()
        self.channel.send(StepDone(step, self.trainer.step, metrics, self.weights, seconds))

    # ---- role switches -------------------------------------------------------------------
    def _switch(self, target: Role, weights: PublishedWeights | None, core_address: str) -> None:
        self.weights = weights or self.weights
        self.core_address = core_address or self.core_address
        state = Role.TO_TRAIN if target == Role.TRAIN else Role.TO_ROLLOUT
        t_start, phases, rank_phases = time.time(), {}, {}
        for phase in PHASES[state]:
            t0 = time.monotonic()
            rank_s = asyncio.run(self._phase(phase))
            rank_s = rank_s or [time.monotonic() - t0] * self.spec.ranks  # every rank took the whole phase
            phases[phase.value], rank_phases[phase.value] = cell_phase_s(rank_s), rank_s
            self.channel.send(PhaseDone(self.index, phase.value, phases[phase.value], rank_s))
        self.role = target
        self.channel.send(RoleDone(self.index, target.value, t_start, phases, rank_phases))

    async def _phase(self, phase: Phase) -> list[float] | None:
        """Run `phase`; returns each rank's seconds in it where they differ (None: all took the whole phase)."""
        from gyre.proxy.admin import ProxyAdmin

        s = self.spec
        if phase in ENGINE_PHASES:
            async with ProxyAdmin(s.proxy_url, s.proxy_admin_token) as proxy:
                jobs = (self._engine_phase(phase, proxy, j) for j in range(len(self.engines)))
                return ranks_from_engines(self.slots, await asyncio.gather(*jobs), s.ranks)
        if self.is_core:
            return None
        if phase in (Phase.OFFLOAD_TRAINER, Phase.ONLOAD_TRAINER):
            await asyncio.to_thread(self._move_trainer, phase)
        elif phase == Phase.PULL_WEIGHTS:
            t0 = time.monotonic()
            await asyncio.to_thread(self._pull)
            return ranks_from_work(time.monotonic() - t0, self.satellite.rank_pull_seconds)
        elif phase == Phase.JOIN_STEP:
            self._stop.clear()
            self._worker = threading.Thread(target=self.satellite.serve, args=(self._stop,), daemon=True)
            self._worker.start()
        elif phase == Phase.FINISH_MICROSTEP:
            self._stop.set()  # the satellite finishes the micro-step in hand, then leaves
            await asyncio.to_thread(self._worker.join)
            self._worker = None
        return None

    async def _engine_phase(self, phase: Phase, proxy, j: int) -> float:
        """`phase` on engine j of the cell; returns its seconds."""
        t0, engine, eid = time.monotonic(), self.engines[j], self.engine_ids[j]
        async with engine.client() as client:
            if phase == Phase.STOP_ADMISSION:
                await proxy.engine_op(eid, "stop_admission")
            elif phase == Phase.HAND_OFF_SESSIONS:
                await proxy.engine_op(eid, "drain")
            elif phase == Phase.RELEASE_ENGINE_MEMORY:
                await engine.release(client)
            elif phase == Phase.LOAD_WEIGHTS:
                await engine.resume(client)
                await serve_weights(engine, eid, proxy, self.weights)
            elif phase == Phase.ANNOUNCE_TO_PROXY:
                await proxy.engine_op(eid, "activate")
        return time.monotonic() - t0

    def _move_trainer(self, phase: Phase) -> None:
        """The trainer's state off the device (the cell serves) or back (it trains), on every rank;
        with `trainer.offload_on_switch` off it stays where it is."""
        from gyre.train.shard import offload_trainer, onload_trainer

        if self.spec.trainer.offload_on_switch:
            self.ranks.run(offload_trainer if phase == Phase.OFFLOAD_TRAINER else onload_trainer)

    def _pull(self) -> None:
        from gyre.train.satellite import SatelliteCell

        if self.satellite is None:
            self.satellite = SatelliteCell(
                self.trainer,
                self.endpoint,
                self.core_address,
                f"cell{self.index}",
                peer_timeout_s=self.spec.control_peer_timeout_s,
                ranks=self.ranks,
                host=self.spec.host,
            )
        self.satellite.pull_latest()

    def close(self) -> None:
        self._stop.set()
        self._closing.set()
        for engine in self.engines:  # they stop while the ranks do
            engine.terminate()
        if self.satellite is not None:
            self.satellite.close()
        if self.publisher is not None:
            self.publisher.close()
        if self.core is not None:
            self.core.close()
        self.ranks.stop()
        for proc in self.followers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # stuck in a collective rank 0 left: nothing to save there
                proc.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for engine in self.engines:
            engine.stop()
        if self.channel is not None:
            self.channel.close()
        self.events.close()


def _start_engines(spec: CellSpec, slots: list) -> list:
    """Start the engines of `slots`, one after another from this thread: a child dies with the thread
    that spawned it (PR_SET_PDEATHSIG), so a pool's threads would take the engines with them."""
    from gyre.engines.launch import make_engine_process

    engines = [make_engine_process(spec.engine, spec.model, slot.base_gpu_id) for slot in slots]
    for engine in engines:
        engine.start()
    return engines


def main(argv: list[str] | None = None) -> NoReturn:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # Slurm's preemption warning is the coordinator's to act on
    spec = CellSpec.from_json(Path(argv[0]).read_text())
    Path(spec.run_dir).mkdir(parents=True, exist_ok=True)
    CellLeader(spec).run()
    exit_at_once(0)  # closed: everything it started has stopped


if __name__ == "__main__":
    main()
