"""A cell leader: one process per cell that owns the cell's engine and trainer and switches roles.

    coordinator ──SwitchRole──> leader ──(proxy admin, engine HTTP, core channel)──> RoleDone(phases)
                  TrainStep ──> core leader: run_step in a worker thread ──> publish ──> StepDone

A local cell is this process (the trainer: the core's owns optimizer and weights; a satellite's
pulls weights and pushes gradients over Mooncake) plus one builtin engine child. Both stay warm:
a switch moves work, not processes, and each of its phases (gyre.scheduler.cells.PHASES) is timed
and reported. The leader exits when its coordinator's channel closes, stopping its engine.

    python -m gyre.cells.leader SPEC_JSON        (gyre.cells.spec.CellSpec as JSON)
"""

import asyncio
import hashlib
import logging
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Client

from gyre.cells.protocol import (CellFailure, CellReady, CheckpointDone, PhaseDone, RoleDone, SaveCheckpoint, Stop,
                                 StepDone, SwitchRole, TrainStep, recv, send)
from gyre.cells.spec import CellSpec
from gyre.scheduler.cells import PHASES, Phase, Role

log = logging.getLogger("gyre.cells.leader")


class CellLeader:
    def __init__(self, spec: CellSpec):
        import torch

        from gyre.engines.launch import BuiltinEngineProcess
        from gyre.train.checkpoint import CheckpointManager
        from gyre.train.trainer import Trainer
        from gyre.transfer import TransferEndpoint

        torch.set_num_threads(1)
        self.spec = spec
        self.index, self.is_core = spec.index, spec.index == 0
        host, port, key = spec.coordinator_address.rsplit(":", 2)
        self.conn = Client((host, int(port)), authkey=bytes.fromhex(key))
        self.engine = BuiltinEngineProcess(spec.engine, spec.model)
        self.engine.start()
        self.trainer = Trainer(spec.model, spec.trainer, seed=spec.seed)
        self.endpoint = TransferEndpoint(spec.host)
        self.role = Role(spec.role)
        self.engine_id = f"cell{self.index}"
        self.checkpoints = CheckpointManager(spec.checkpoint_dir, spec.trainer.checkpoint_keep_last)
        self.weights: dict | None = None
        self.core_address = ""
        """The newest weights this cell's engine should serve (descriptor + version)."""
        self._published: deque = deque(maxlen=2)  # the last two buffers stay readable while engines load
        self._worker: threading.Thread | None = None
        self._result: dict = {}
        self._stop = threading.Event()
        self.core = self.satellite = None
        if self.is_core:
            from gyre.train.elastic import CoreServer

            self._load_initial_weights()
            self.core = CoreServer(self.trainer, self.endpoint)
            self.weights = self._publish()

    # ---- start ---------------------------------------------------------------------------
    def _load_initial_weights(self) -> None:
        """The latest checkpoint (resume), else the initial model directory, else the seeded init."""
        from gyre.models.checkpoint import load_checkpoint

        if self.spec.resume and self.checkpoints.load_latest(self.trainer) is not None:
            return
        if self.spec.init_weights:
            _, tensors = load_checkpoint(self.spec.init_weights)
            self.trainer.load_engine_weights(tensors)

    def _publish(self) -> dict:
        descriptor, buffer = self.endpoint.publish_tensors(self.trainer.engine_weights())
        if len(self._published) == self._published.maxlen:
            self.endpoint.unregister(self._published[0])
        self._published.append(buffer)
        return {**descriptor, "version": self.trainer.step}

    def ready(self) -> CellReady:
        core = self.core.address if self.core else ""
        return CellReady(self.index, self.engine.url, core, self.weights, self.trainer.step,
                         self.weights_digest() if self.is_core else "")

    def weights_digest(self) -> str:
        return hashlib.sha256(self.trainer.flat.weights.detach().cpu().numpy().tobytes()).hexdigest()[:16]

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        send(self.conn, self.ready())
        try:
            while True:
                self._reap_worker()
                if not self.conn.poll(0.05):
                    continue
                msg = recv(self.conn)
                if isinstance(msg, Stop):
                    return
                self._handle(msg)
        except (EOFError, OSError):
            log.warning("cell %d: the coordinator's channel closed; stopping", self.index)
        finally:
            self.close()

    def _handle(self, msg) -> None:
        try:
            if isinstance(msg, SwitchRole):
                self._switch(Role(msg.target), msg.weights, msg.core_address)
            elif isinstance(msg, TrainStep):
                self._start_step(msg)
            elif isinstance(msg, SaveCheckpoint):
                t0 = time.monotonic()
                path = self.checkpoints.save(self.trainer, msg.extra)
                send(self.conn, CheckpointDone(msg.step, str(path), time.monotonic() - t0, self.weights_digest()))
            else:
                raise TypeError(f"unexpected message {type(msg).__name__}")
        except Exception as e:  # reported, the leader keeps serving: the coordinator decides
            log.exception("cell %d failed on %s", self.index, type(msg).__name__)
            send(self.conn, CellFailure(self.index, f"{type(msg).__name__}: {e!r}"))

    # ---- training steps (core) -----------------------------------------------------------
    def _start_step(self, msg: TrainStep) -> None:
        if self._worker is not None:
            raise RuntimeError(f"step {msg.step} sent while another step runs")
        self._result = {"step": msg.step, "t0": time.monotonic()}

        def work():
            try:
                self._result["metrics"] = self.core.run_step(msg.batches)
            except Exception as e:
                self._result["error"] = repr(e)

        self._worker = threading.Thread(target=work, name=f"step-{msg.step}", daemon=True)
        self._worker.start()

    def _reap_worker(self) -> None:
        if self._worker is None or self._worker.is_alive() or not self.is_core:
            return
        self._worker = None
        r = self._result
        if "error" in r:
            send(self.conn, CellFailure(self.index, f"step {r['step']}: {r['error']}"))
            return
        self.weights = self._publish()
        send(self.conn, StepDone(r["step"], self.trainer.step, r["metrics"], self.weights, time.monotonic() - r["t0"]))

    # ---- role switches -------------------------------------------------------------------
    def _switch(self, target: Role, weights: dict | None, core_address: str) -> None:
        self.weights = weights or self.weights
        self.core_address = core_address or self.core_address
        state = Role.TO_TRAIN if target == Role.TRAIN else Role.TO_ROLLOUT
        t_start, phases = time.time(), {}
        for phase in PHASES[state]:
            t0 = time.monotonic()
            asyncio.run(self._phase(phase))
            phases[phase.value] = time.monotonic() - t0
            send(self.conn, PhaseDone(self.index, phase.value, phases[phase.value]))
        self.role = target
        send(self.conn, RoleDone(self.index, target.value, t_start, phases))

    async def _phase(self, phase: Phase) -> None:
        from gyre.proxy.admin import ProxyAdmin

        s = self.spec
        async with ProxyAdmin(s.proxy_url, s.proxy_admin_token) as proxy, self.engine.client() as engine:
            if phase == Phase.STOP_ADMISSION:
                await proxy.engine_op(self.engine_id, "stop_admission")
            elif phase == Phase.HAND_OFF_SESSIONS:
                await proxy.engine_op(self.engine_id, "drain")
            elif phase == Phase.RELEASE_ENGINE_MEMORY:
                await engine.release_memory()
            elif phase == Phase.PULL_WEIGHTS and not self.is_core:
                await asyncio.to_thread(self._join_core)
            elif phase == Phase.JOIN_STEP and not self.is_core:
                self._stop.clear()
                self._worker = threading.Thread(target=self.satellite.serve_until, args=(self._stop,), daemon=True)
                self._worker.start()
            elif phase == Phase.FINISH_MICROSTEP and not self.is_core:
                self._stop.set()
                await asyncio.to_thread(self._worker.join)
                self._worker = None
            elif phase == Phase.LOAD_WEIGHTS:
                await engine.resume_memory()
                w = dict(self.weights)
                await engine.update_weights_from_tensor(weight_version=str(w.pop("version")),
                                                        load_format="gyre_transfer", **w)
            elif phase == Phase.ANNOUNCE_TO_PROXY:
                await proxy.engine_op(self.engine_id, "activate")

    def _join_core(self) -> None:
        from gyre.cells.satellite import LeavingSatellite

        self.satellite = LeavingSatellite(self.trainer, self.endpoint, self.core_address)
        self.satellite.pull()

    def close(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self.core is not None:
            self.core.close()
        self.engine.stop()
        self.conn.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    CellLeader(CellSpec.from_json(argv[0])).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
