"""The core's door for satellites: the satellite <-> core half of the control protocol
(gyre/control/messages.py), one thread per satellite channel.

    accept ─> Join ─> Welcome | Refused      Claim ─> Work | Wait | Evicted      Done ─> the slot is folded
    Pull ─> WeightVersion ... PullDone       Leave / a closed channel ─> its claims go back to the queue

`SatelliteDoor` is CoreServer's protocol side (gyre/train/elastic.py): it reads and changes the
open step, the claim queue and the slots under the server's condition variable, which owns them.
"""

import logging
import threading
import time
from collections import Counter

from gyre.control import messages as m
from gyre.control.transport import Channel, ChannelClosed

CORE = "core"
logger = logging.getLogger("gyre.train.elastic")


class SatelliteDoor:
    """Accepts satellites and answers their messages; mixed into CoreServer, whose state it shares."""

    def _accept_loop(self) -> None:
        while True:
            try:
                ch = self._listener.accept()
            except ChannelClosed:
                return
            with self._cond:
                self._channels.add(ch)
            t = threading.Thread(target=self._serve, args=(ch,), daemon=True, name=f"core-{ch.peer}")
            self._threads.append(t)
            t.start()

    def _serve(self, ch: Channel) -> None:
        cell = None
        try:
            cell = self._welcome(ch, ch.recv(timeout_s=60))
            while cell is not None:
                msg = ch.recv()
                if isinstance(msg, m.Claim):
                    ch.send(self._grant(cell))
                elif isinstance(msg, m.Done):
                    self._accept_result(cell, msg)
                elif isinstance(msg, m.Pull):
                    ch.send(self._start_pull(cell))
                elif isinstance(msg, m.PullDone):
                    self._end_pull(cell)
                elif isinstance(msg, m.Leave):
                    self._release(cell)  # it finished its micro-step first; nothing should be held
                elif not isinstance(msg, m.Heartbeat):
                    raise m.ProtocolError(f"a satellite may not send {type(msg).__name__} to the core")
        except m.ProtocolError as e:
            logger.error("dropping %s (%s): %s", cell or "a peer", ch.peer, e)
        except ChannelClosed:
            pass  # the satellite died or the core is closing: release below
        finally:
            ch.close()
            with self._cond:
                self._channels.discard(ch)
            if cell is not None:
                with self._cond:
                    if self._cells.get(cell) is ch:
                        del self._cells[cell]
                    self._evicted.discard(cell)
                    self._free.extend(self._quarantine.pop(cell, []))  # the process is gone now
                    self._cond.notify_all()
                self._release(cell)

    def _welcome(self, ch: Channel, msg: object) -> str | None:
        if not isinstance(msg, m.Join):
            raise m.ProtocolError(f"expected Join first, got {type(msg).__name__}")
        layout = (self.ranks.num_ranks, self.trainer.cfg.tensor_parallel_size)
        if (msg.ranks, msg.tp) != layout:
            ch.send(
                m.Refused(f"layout (ranks, tensor parallel) {(msg.ranks, msg.tp)} differs from the core's {layout}")
            )
            return None
        if [tuple(map(tuple, x)) for x in msg.signature] != [
            tuple(map(tuple, x)) for x in self.trainer.flat.signature()
        ]:
            ch.send(m.Refused("model parameters differ from the core's (names, shapes)"))
            return None
        with self._cond:
            if msg.cell in self._cells or msg.cell == CORE:
                ch.send(m.Refused(f"cell name {msg.cell!r} is in use"))
                return None
            self._cells[msg.cell] = ch
            version = self.trainer.step
        ch.send(m.Welcome(self._peers, version))
        return msg.cell

    def _release(self, cell: str) -> None:
        with self._cond:
            step = self._step
            for ms in self._queue.release(cell) if step is not None else []:
                self._free.append(step.slot_of.pop(ms.index))
            self._end_pull(cell, all_of_them=True)
            self._cond.notify_all()

    def _grant(self, cell: str) -> object:
        with self._cond:
            step = self._step
            if cell in self._evicted:
                return m.Evicted()
            if step is None or not self._free or (ms := self._queue.claim(cell, time.monotonic())) is None:
                return m.Wait()
            step.slot_of[ms.index] = slot = self._free.popleft()
            return m.Work(ms.index, step.version, slot, step.batches[ms.index])

    def _accept_result(self, cell: str, msg: m.Done) -> None:
        with self._cond:
            step = self._step
            ms = None if step is None else step.micro.get(msg.index)
            if ms is not None and self._queue.complete(ms, cell):
                step.stats[msg.index] = msg.stats
                step.owner[msg.index] = msg.replica
                step.timing[msg.index] = (cell, msg.seconds, time.time(), msg.rank)  # its result just arrived
            self._cond.notify_all()

    def _start_pull(self, cell: str) -> m.WeightVersion:
        with self._cond:
            while self._applying:
                self._cond.wait()
            self._readers[cell] += 1
            self._pull_started[cell] = time.monotonic()
            return m.WeightVersion(self.trainer.step)

    def _end_pull(self, cell: str, all_of_them: bool = False) -> None:
        with self._cond:
            if self._readers[cell] > 0:
                self._readers[cell] = 0 if all_of_them else self._readers[cell] - 1
            self._readers += Counter()
            self._cond.notify_all()
