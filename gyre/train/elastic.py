"""Core and satellite cells computing one optimizer step together.

    core cell (owns optimizer state)                         satellite cell
    ------------------------------------------------         ---------------------------------
    weights [N] fp32, registered  <── Mooncake read ──────  pull when the step's version is new
    grad slots [K, N], registered <── Mooncake write ─────  write the micro-step's flat gradient
    control listener (TCP, authkey) <── hello/claim/done ─>  claim -> (index, slot, batch, normaliser)
    run_step: compute micro-steps too, fold finished slots in index order, then one optimizer step

Bytes move over the Mooncake Transfer Engine in both directions (P2P handshake; TCP here, RDMA on
clusters): one-sided reads and writes into registered memory need no collective communicator, so
a cell can join or leave between micro-steps without rebuilding anything, and a dead cell cannot
stall a collective (an MPI reduce would need every member alive and an intercommunicator per
join). Small control messages (a few KB: claims, micro-batch tensors) go over a local TCP
connection; a closed connection is how the core learns that a satellite died, and its claimed
micro-step goes back to the ledger to be redone. A satellite that hangs (connection open, no
result) loses its claim after `claim_timeout_s` and gets no more work. Gradients are added in micro-step order whoever
computed them, so the step does not depend on the split (bitwise on CPU).

Weights never change while a satellite pulls: the core steps only after every micro-step of the
step has been accepted, and a satellite pulls only while holding a claim. One slot per claim keeps
the core's memory bounded (`num_grad_slots`); a freed slot goes to the back of the queue so a late
write of a dead satellite cannot land in a slot that is being reused at once.
"""

import logging
import os
import pickle
import socket
import threading
import time
from collections import deque
from multiprocessing.connection import Client, Connection, Listener

import torch
import torch.distributed as dist

from gyre.errors import GyreError
from gyre.train.ledger import MicroStepLedger
from gyre.train.loss import finish_stats, merge_stats
from gyre.train.trainer import Trainer, prepare_step
from gyre.transfer import TransferEndpoint
from gyre.trajectory.sample import PackedBatch

CORE = "core"
logger = logging.getLogger(__name__)


class ElasticError(GyreError):
    """The core and a satellite cannot work together (mismatched model, lost core)."""


def _send(conn: Connection, msg: tuple) -> None:
    conn.send_bytes(pickle.dumps(msg))  # plain pickle: torch's shared-memory reductions need a common parent


def _recv(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())


class CoreServer:
    """The core cell's side: publishes weights, hands out micro-steps, accumulates, steps once."""

    def __init__(self, trainer: Trainer, endpoint: TransferEndpoint):
        if dist.get_world_size() != 1:
            raise ElasticError("core/satellite steps are built for one-rank cells only (per-rank pulls are not built)")
        self.trainer, self.endpoint = trainer, endpoint
        n = trainer.flat.weights.numel()
        self.slots = torch.zeros(trainer.cfg.num_grad_slots, n, dtype=torch.float32, device=trainer.flat.weights.device)
        self._weights_addr = endpoint.register(trainer.flat.weights)
        self._slots_addr = endpoint.register(self.slots)
        self._cond = threading.Condition()
        self._free = deque(range(trainer.cfg.num_grad_slots))
        self._step: dict | None = None
        self._evicted: set[str] = set()
        self._quarantine: dict[str, list[int]] = {}  # slots an evicted (hung) cell may still write
        self._closing = False
        self._conns: list[Connection] = []
        self._authkey = os.urandom(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=self._authkey)
        self._threads = [threading.Thread(target=self._accept_loop, daemon=True, name="core-accept")]
        self._threads[0].start()

    @property
    def address(self) -> str:
        """What a satellite needs to join: "host:port:authkey-hex"."""
        host, port = self._listener.address
        return f"{host}:{port}:{self._authkey.hex()}"

    def progress(self) -> tuple[dict[int, str], dict[int, str]]:
        """Snapshot of the running step: (micro-step -> cell computing it, micro-step -> cell that did it)."""
        with self._cond:
            if self._step is None:
                return {}, {}
            ledger = self._step["ledger"]
            return dict(ledger.claims), dict(ledger.done_by)

    # ---- the step --------------------------------------------------------------------------
    def run_step(self, batches: list[PackedBatch]) -> dict[str, float]:
        """Compute one optimizer step over `batches` with whichever cells are connected.

        Returns:
            Loss metrics, grad norm, `microsteps_by/<cell>`, `microsteps_redone`, exclusions.
        Raises:
            BatchError: the step has a structurally broken batch or nothing trainable.
        """
        batches, normaliser, excluded = prepare_step(batches, self.trainer.model_cfg.vocab_size)
        acc = torch.zeros_like(self.trainer.flat.weights)
        ledger = MicroStepLedger(len(batches))
        with self._cond:
            self._step = {"ledger": ledger, "batches": batches, "normaliser": normaliser, "version": self.trainer.step,
                          "slot_of": {}, "stats": {}, "folded": 0}
            self._cond.notify_all()
        try:
            while True:
                job = self._next_core_job(acc)
                if job is None:
                    break
                self._compute_on_core(acc, *job)
        finally:
            with self._cond:
                step, self._step = self._step, None
                # Normally empty. After an error: results go back to the pool, in-flight claims of
                # satellites keep their slot quarantined (a late write may still land there).
                for index, slot in step["slot_of"].items():
                    cell = ledger.claims.get(index, CORE)
                    (self._free if cell == CORE else self._quarantine.setdefault(cell, [])).append(slot)
        stats = {}
        for i in range(len(batches)):
            stats = merge_stats(stats, step["stats"][i])
        by_cell = {}
        for cell in ledger.done_by.values():
            by_cell[f"microsteps_by/{cell}"] = by_cell.get(f"microsteps_by/{cell}", 0) + 1
        metrics = finish_stats(stats) | excluded | by_cell | {"microsteps_redone": ledger.num_redone}
        return metrics | self.trainer.apply_gradient(acc)

    def _next_core_job(self, acc: torch.Tensor) -> tuple[int, int | None] | None:
        """Fold finished slots in order; return a (micro-step, slot) for the core, or None when done.

        The core also takes the next micro-step to fold when no slot is free (even with
        core_computes_microsteps off): it adds that one straight into the accumulator, so slots
        held by later results or quarantined by a hung cell can never stall the step.
        """
        step = self._step
        with self._cond:
            while True:
                self._fold(step, acc)
                ledger = step["ledger"]
                if step["folded"] == ledger.num_microsteps:
                    return None
                self._evict_overdue(step)
                if ledger.has_pending and self._free and self.trainer.cfg.core_computes_microsteps:
                    index = ledger.claim(CORE, time.monotonic())
                    step["slot_of"][index] = slot = self._free.popleft()
                    return index, slot
                if not self._free and ledger.next_pending() == step["folded"]:
                    return ledger.claim(CORE, time.monotonic()), None
                self._cond.wait(timeout=0.05 if self.trainer.cfg.claim_timeout_s else 1.0)

    def _evict_overdue(self, step: dict) -> None:
        """Take micro-steps back from cells that hold one past `claim_timeout_s` (hung, not dead).

        Their slots stay quarantined until their connection closes (the process is gone): a hung
        process that wakes up could still write into them.
        """
        timeout = self.trainer.cfg.claim_timeout_s
        if not timeout:
            return
        for cell in step["ledger"].overdue(time.monotonic(), timeout) - {CORE}:
            self._evicted.add(cell)
            lost = step["ledger"].release(cell)
            self._quarantine.setdefault(cell, []).extend(step["slot_of"].pop(i) for i in lost)
            logger.warning("satellite %s held micro-steps %s over %.1f s: redoing them elsewhere", cell, lost, timeout)

    def _fold(self, step: dict, acc: torch.Tensor) -> None:
        ledger = step["ledger"]
        while step["folded"] in ledger.done_by:
            slot = step["slot_of"].pop(step["folded"])
            acc.add_(self.slots[slot])
            self._free.append(slot)
            step["folded"] += 1
            self._cond.notify_all()

    def _compute_on_core(self, acc: torch.Tensor, index: int, slot: int | None) -> None:
        step = self._step
        grad, stats = self.trainer.microstep(step["batches"][index], step["normaliser"])
        if slot is None:
            acc.add_(grad)  # index is the next to fold: every earlier micro-step is in acc already
        else:
            self.slots[slot].copy_(grad)
        with self._cond:
            step["ledger"].complete(CORE, index)
            step["stats"][index] = stats
            if slot is None:
                step["folded"] += 1
            self._cond.notify_all()

    # ---- satellites ------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        count = 0
        while True:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):
                if self._closing:
                    return
                continue  # a failed handshake (wrong authkey): keep serving others
            if self._closing:
                conn.close()
                return
            count += 1
            self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn, f"satellite{count}"), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: Connection, cell: str) -> None:
        try:
            msg = _recv(conn)
            if msg[0] != "hello" or msg[1] != self.trainer.flat.signature():
                _send(conn, ("refused", "model parameters differ from the core's (names, shapes)"))
                return
            _send(conn, ("welcome", cell, self.endpoint.session_id, self._weights_addr, self.trainer.flat.weights.numel()))
            while True:
                msg = _recv(conn)
                if msg[0] == "claim":
                    _send(conn, self._grant(cell))
                elif msg[0] == "done":
                    self._accept_result(cell, msg[1], msg[2])
                elif msg[0] == "leave":
                    return
        except (EOFError, OSError):
            pass  # the satellite died or the core is closing: release below
        finally:
            with self._cond:
                if self._step is not None:
                    for index in self._step["ledger"].release(cell):
                        self._free.append(self._step["slot_of"].pop(index))
                self._free.extend(self._quarantine.pop(cell, []))  # the process is gone now
                self._cond.notify_all()
            conn.close()

    def _grant(self, cell: str) -> tuple:
        with self._cond:
            step = self._step
            if cell in self._evicted:
                return ("evicted",)
            if step is None or not self._free or not step["ledger"].has_pending:
                return ("wait",)
            index = step["ledger"].claim(cell, time.monotonic())
            slot = self._free.popleft()
            step["slot_of"][index] = slot
            addr = self._slots_addr + slot * self.slots.shape[1] * 4
            return ("work", index, step["version"], addr, step["batches"][index], step["normaliser"])

    def _accept_result(self, cell: str, index: int, stats: dict) -> None:
        with self._cond:
            if self._step is not None and self._step["ledger"].complete(cell, index):
                self._step["stats"][index] = stats
            self._cond.notify_all()

    def close(self) -> None:
        """Stop serving: satellites see their connection close and exit their loop."""
        self._closing = True
        host, port, _ = self.address.split(":")
        try:
            Client((host, int(port)), authkey=self._authkey).close()  # wake the accept loop
        except OSError:
            pass
        self._listener.close()
        for conn in list(self._conns):
            # Shut the socket down (not close it) so the serving thread sees EOF and closes it itself.
            try:
                socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM).shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its thread
        for t in self._threads[1:]:
            t.join(timeout=5)
        self.endpoint.unregister(self.slots)
        self.endpoint.unregister(self.trainer.flat.weights)


class SatelliteCell:
    """A satellite's side: join a core, pull weights per version, compute claimed micro-steps."""

    def __init__(self, trainer: Trainer, endpoint: TransferEndpoint, core_address: str):
        if dist.get_world_size() != 1:
            raise ElasticError("core/satellite steps are built for one-rank cells only (per-rank pulls are not built)")
        host, port, key = core_address.rsplit(":", 2)
        self.trainer, self.endpoint = trainer, endpoint
        self._conn = Client((host, int(port)), authkey=bytes.fromhex(key))
        endpoint.register(trainer.flat.weights)
        endpoint.register(trainer.grad)
        _send(self._conn, ("hello", trainer.flat.signature()))
        reply = _recv(self._conn)
        if reply[0] != "welcome":
            raise ElasticError(f"core refused the satellite: {reply[1]}")
        _, self.name, self._core_session, self._weights_addr, numel = reply
        self.version = -1
        self.num_computed = 0
        self.pull_seconds: list[float] = []
        self.microstep_seconds: list[float] = []
        """Per micro-step: forward, backward and the gradient write to the core."""

    def serve(self, max_microsteps: int | None = None) -> int:
        """Claim and compute micro-steps until the core goes away or `max_microsteps` are done.

        Returns:
            The number of micro-steps this satellite computed.
        """
        try:
            while max_microsteps is None or self.num_computed < max_microsteps:
                _send(self._conn, ("claim",))
                reply = _recv(self._conn)
                if reply[0] == "wait":
                    time.sleep(self.trainer.cfg.claim_poll_s)
                    continue
                if reply[0] == "evicted":
                    break  # presumed hung: the core redid our work; rejoin as a new cell if needed
                _, index, version, slot_addr, batch, normaliser = reply
                if version != self.version:
                    self.pull()
                    self.version = version
                t0 = time.perf_counter()
                grad, stats = self.trainer.microstep(batch, normaliser)
                self.endpoint.write(self._core_session, slot_addr, grad)
                self.microstep_seconds.append(time.perf_counter() - t0)
                _send(self._conn, ("done", index, stats))
                self.num_computed += 1
            _send(self._conn, ("leave",))
        except (EOFError, OSError):
            pass  # the core closed: this cell's training role is over
        finally:
            self._conn.close()
        return self.num_computed

    def pull(self) -> None:
        """Copy the core's current weights into this cell's (registered) flat buffer."""
        t0 = time.perf_counter()
        self.endpoint.read(self._core_session, self._weights_addr, self.trainer.flat.weights)
        self.pull_seconds.append(time.perf_counter() - t0)
