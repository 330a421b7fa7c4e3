"""A control-channel peer in its own process, for the transport contract test.

    python control_peer.py ADDRESS echo      send back every message until Leave
(each prints "connected" once its channel is up)
    python control_peer.py ADDRESS garbage   send undecodable bytes, a non-message, a forbidden global,
                                             then Heartbeat(<its pid>, 0), then wait to be killed
"""

import os
import pickle
import sys
import time

from gyre.control.messages import Heartbeat, Leave
from gyre.control.transport import connect


def main(address: str, mode: str) -> None:
    ch = connect(address)
    print("connected", flush=True)
    if mode == "echo":
        while not isinstance(msg := ch.recv(), Leave):
            ch.send(msg)
        ch.send(msg)
    elif mode == "garbage":
        ch._send_bytes(b"\x80\x05not a pickle")
        ch._send_bytes(pickle.dumps({"claim": 1}))
        ch._send_bytes(pickle.dumps(print))  # a global outside the allowlist
        ch.send(Heartbeat(os.getpid(), 0.0))  # under mpiexec the test's child is not this process
        time.sleep(600)
    ch.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
