"""A satellite's training role that can be told to leave after the micro-step it is computing."""

import threading
import time

from gyre.train.elastic import SatelliteCell, _recv, _send


class LeavingSatellite(SatelliteCell):
    """`serve_until(stop)`: claim and compute until `stop` is set, finish the micro-step in hand, leave."""

    def serve_until(self, stop: threading.Event) -> int:
        try:
            while not stop.is_set():
                _send(self._conn, ("claim",))
                reply = _recv(self._conn)
                if reply[0] == "wait":
                    time.sleep(self.trainer.cfg.claim_poll_s)
                    continue
                if reply[0] == "evicted":
                    break
                _, index, version, slot_addr, batch, normaliser = reply
                if version != self.version:
                    self.pull()
                    self.version = version
                grad, stats = self.trainer.microstep(batch, normaliser)
                self.endpoint.write(self._core_session, slot_addr, grad)
                _send(self._conn, ("done", index, stats))
                self.num_computed += 1
            _send(self._conn, ("leave",))
        except (EOFError, OSError):
            pass
        finally:
            self._conn.close()
        return self.num_computed
