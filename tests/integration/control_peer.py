"""A control-channel peer in its own process, for the transport contract test.

    python control_peer.py ADDRESS echo      send back every message until Leave
    python control_peer.py ADDRESS garbage   send undecodable bytes, then a non-message, then Heartbeat("after", 0)
    python control_peer.py ADDRESS idle      say Heartbeat("idle", 0), then wait to be killed
"""

import pickle
import sys
import time

from gyre.control.messages import Heartbeat, Leave
from gyre.control.transport import ChannelClosed, connect


def main(address: str, mode: str) -> None:
    ch = connect(address)
    if mode == "echo":
        while not isinstance(msg := ch.recv(), Leave):
            ch.send(msg)
        ch.send(msg)
    elif mode == "garbage":
        ch._send_bytes(b"\x80\x05not a pickle")
        ch._send_bytes(pickle.dumps({"claim": 1}))
        ch._send_bytes(pickle.dumps(print))  # a global outside the allowlist
        ch.send(Heartbeat("after", 0.0))
        try:
            ch.recv()
        except ChannelClosed:
            pass
    elif mode == "idle":
        ch.send(Heartbeat("idle", 0.0))
        time.sleep(600)
    ch.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
