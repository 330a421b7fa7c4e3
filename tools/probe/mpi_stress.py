"""Stress the MPI control transport where the coordinator once crashed: a listener accepting peers
while its other channels send and probe from their own threads (heartbeats every few ms).

    python tools/probe/mpi_stress.py [--impl PATH] [--peers 3] [--seconds 60] [--hold-s 0.05]
    python tools/probe/mpi_stress.py --once --peers 5 --stagger-s 8 --seconds 100

Starts one listener (this process) and `--peers` peers, each under `mpiexec -n 1`, that connect,
send a burst of messages, hold the channel `--hold-s`, close and connect again until the time is
up (`--once`: connect once and keep talking, as Gyre's leaders do). `--impl` loads another version
of gyre/control/mpi.py (e.g. `git show 31e46ba:gyre/control/mpi.py > /tmp/old_mpi.py`,
the lock-per-channel one) to compare. Prints the channels accepted and messages received, and
the exit status of every process (-11: a segmentation fault); last line one JSON object.
"""

import argparse
import faulthandler
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gyre.common import jsonio  # noqa: E402
from gyre.control import messages as m  # noqa: E402
from gyre.control.transport import ChannelClosed, ChannelTimeout  # noqa: E402

BEAT_S = 0.002


def _load(impl: str | None):
    if impl is None:
        from gyre.control import mpi

        return mpi
    spec = importlib.util.spec_from_file_location("mpi_under_test", impl)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peer(mpi, port_file: str, until: float, once: bool, hold_s: float) -> None:
    while time.time() < until:
        ch = mpi.mpi_connect(port_file, timeout_s=30, heartbeat_s=BEAT_S, peer_timeout_s=30)
        for k in range(50):
            ch.send(m.WeightVersion(k))
        while once and time.time() < until:  # Gyre's pattern: one channel per peer for the run
            ch.send(m.WeightVersion(0))
            time.sleep(0.01)
        time.sleep(hold_s)
        ch.close()


def listen(mpi, args) -> dict:
    port_file = os.path.join(tempfile.mkdtemp(), "stress.port")
    listener = mpi.MpiListener(port_file, heartbeat_s=BEAT_S, peer_timeout_s=30)
    until = time.time() + args.seconds
    cmd = [str(Path(sys.executable).with_name("mpiexec")), "-n", "1", sys.executable, __file__, "--peer", port_file]
    cmd += ["--until", str(until), "--hold-s", str(args.hold_s)] + (["--impl", args.impl] if args.impl else [])
    cmd += ["--once"] if args.once else []
    peers = []
    for _ in range(args.peers):  # staggered: the listener accepts while earlier channels talk
        peers.append(subprocess.Popen(cmd))
        time.sleep(args.stagger_s)
    counts = {"accepted": 0, "received": 0}

    def serve(ch) -> None:
        while True:
            try:
                ch.recv(timeout_s=1)
                counts["received"] += 1
            except ChannelTimeout:
                continue
            except ChannelClosed:
                ch.close()
                return

    while time.time() < until + 5 and any(p.poll() is None for p in peers):
        try:
            ch = listener.accept(timeout_s=1)
        except ChannelTimeout:
            continue
        counts["accepted"] += 1
        threading.Thread(target=serve, args=(ch,), daemon=True).start()
    codes = [p.wait(timeout=60) for p in peers]
    listener.close()
    return {**counts, "peer_exit_codes": codes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", help="another gyre/control/mpi.py to test")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--once", action="store_true", help="each peer connects once (else: reconnects in a loop)")
    parser.add_argument("--stagger-s", type=float, default=0.0, help="between starting two peers")
    parser.add_argument("--hold-s", type=float, default=0.05, help="how long a peer keeps a channel open")
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--until", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    faulthandler.enable()  # a crash inside MPI leaves every thread's Python stack
    mpi = _load(args.impl)
    if args.peer:
        peer(mpi, args.peer, args.until, args.once, args.hold_s)
        return
    result = listen(mpi, args)
    print(f"accepted {result['accepted']} channels, received {result['received']} messages")
    print(jsonio.dumps({"impl": args.impl or "gyre/control/mpi.py", **result}))


if __name__ == "__main__":
    main()
