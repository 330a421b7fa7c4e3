"""The core's door for satellites: the satellite <-> core half of the control protocol
(gyre/control/messages.py), one thread per satellite channel.

    accept ─> Join ─> Welcome | Refused      Claim ─> Work | Wait | Evicted      Done ─> the slot is folded
    Pull ─> WeightVersion ... PullDone       Leave / a closed channel ─> its claims go back to the queue

The door only speaks the protocol: what a message changes (claims, slots, readers of the weights)
is the core's state's to do (gyre.train.core_state.CoreState).
"""

import logging
import threading

from gyre.control import messages as m
from gyre.control.transport import Channel, ChannelClosed, Listener
from gyre.train.core_state import CoreState

logger = logging.getLogger("gyre.train.elastic")


class SatelliteDoor:
    """Accepts satellites on `listener` and answers their messages from `state`.

    Args:
        peers: what a joining satellite needs to reach the core's ranks (Welcome.peers).
        layout: the core's (ranks, tensor parallel size); a satellite must match it.
        signature: the core's parameter names and shapes; a satellite must match it.
    """

    def __init__(self, state: CoreState, listener: Listener, peers: list, layout: tuple[int, int], signature: list):
        self.state, self.listener, self.peers = state, listener, peers
        self.layout, self.signature = layout, [tuple(map(tuple, x)) for x in signature]
        self._lock = threading.Lock()
        self._channels: set[Channel] = set()
        self._threads = [threading.Thread(target=self._accept_loop, daemon=True, name="core-accept")]
        self._threads[0].start()

    @property
    def address(self) -> str:
        return self.listener.address

    def close(self) -> None:
        """Stop serving: satellites see their channel close and leave their loop."""
        self.listener.close()
        with self._lock:
            channels = list(self._channels)
        for ch in channels:
            ch.close()
        for t in list(self._threads):
            t.join(timeout=5)

    def _accept_loop(self) -> None:
        while True:
            try:
                ch = self.listener.accept()
            except ChannelClosed:
                return
            t = threading.Thread(target=self._serve, args=(ch,), daemon=True, name=f"core-{ch.peer}")
            with self._lock:
                self._channels.add(ch)
                self._threads.append(t)
            t.start()

    def _serve(self, ch: Channel) -> None:
        cell = None
        try:
            cell = self._welcome(ch, ch.recv(timeout_s=60))
            while cell is not None:
                self._answer(cell, ch, ch.recv())
        except m.ProtocolError as e:
            logger.error("dropping %s (%s): %s", cell or "a peer", ch.peer, e)
        except ChannelClosed:
            pass  # the satellite died or the core is closing: its claims go back below
        finally:
            ch.close()
            with self._lock:
                self._channels.discard(ch)
            if cell is not None:
                self.state.gone(cell, ch)

    def _answer(self, cell: str, ch: Channel, msg: object) -> None:
        if isinstance(msg, m.Claim):
            ch.send(self.state.grant(cell))
        elif isinstance(msg, m.Done):
            self.state.accept(cell, msg)
        elif isinstance(msg, m.Pull):
            ch.send(m.WeightVersion(self.state.start_pull(cell)))
        elif isinstance(msg, m.PullDone):
            self.state.end_pull(cell)
        elif isinstance(msg, m.Leave):
            self.state.release(cell)  # it finished its micro-step first; nothing should be held
        elif not isinstance(msg, m.Heartbeat):
            raise m.ProtocolError(f"a satellite may not send {type(msg).__name__} to the core")

    def _welcome(self, ch: Channel, msg: object) -> str | None:
        if not isinstance(msg, m.Join):
            raise m.ProtocolError(f"expected Join first, got {type(msg).__name__}")
        if (msg.ranks, msg.tp) != self.layout:
            ch.send(
                m.Refused(
                    f"layout (ranks, tensor parallel) {(msg.ranks, msg.tp)} differs from the core's {self.layout}"
                )
            )
            return None
        if [tuple(map(tuple, x)) for x in msg.signature] != self.signature:
            ch.send(m.Refused("model parameters differ from the core's (names, shapes)"))
            return None
        version = self.state.join(msg.cell, ch)
        if version is None:
            ch.send(m.Refused(f"cell name {msg.cell!r} is in use"))
            return None
        ch.send(m.Welcome(self.peers, version))
        return msg.cell
