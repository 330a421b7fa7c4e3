"""A control-channel peer in its own process, for the transport contract test.

    python control_peer.py ADDRESS echo [PEER_TIMEOUT_S]   send back every message until Leave; while
                                             none comes, print "listened S s" every half second
(each prints "connected" once its channel is up)
    python control_peer.py ADDRESS garbage   send undecodable bytes, a non-message, a forbidden global,
                                             then Heartbeat(<its pid>, 0), then wait to be killed
    python control_peer.py ADDRESS chatter   send Heartbeat(<its pid>, t) and read without pause until killed
"""

import os
import pickle
import sys
import time

from gyre.control.messages import Heartbeat, Leave
from gyre.control.transport import ChannelTimeout, connect


def main(address: str, mode: str, peer_timeout_s: float = 5.0) -> None:
    ch = connect(address, peer_timeout_s=peer_timeout_s)
    print("connected", flush=True)
    if mode == "echo":
        t0 = time.monotonic()
        while True:
            try:
                msg = ch.recv(timeout_s=0.5)
            except ChannelTimeout:  # still no message, and the listener not silent for too long
                print(f"listened {time.monotonic() - t0:.1f} s", flush=True)
                continue
            if isinstance(msg, Leave):
                break
            ch.send(msg)
        ch.send(msg)
    elif mode == "garbage":
        ch._send_bytes(b"\x80\x05not a pickle")
        ch._send_bytes(pickle.dumps({"claim": 1}))
        ch._send_bytes(pickle.dumps(print))  # a global outside the allowlist
        ch.send(Heartbeat(os.getpid(), 0.0))  # under mpiexec the test's child is not this process
        time.sleep(600)
    elif mode == "chatter":
        while True:
            ch.send(Heartbeat(os.getpid(), time.time()))
            try:
                ch.recv(timeout_s=0.01)
            except ChannelTimeout:
                pass
    ch.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(float, sys.argv[3:]))
