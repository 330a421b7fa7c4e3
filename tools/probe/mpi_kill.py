"""A peer of the MPI control transport dies (SIGKILL) while the listener sends to it: does a send
to the dead peer block the listener's other channels (every MPI call of a process shares one lock)?

    python tools/probe/mpi_kill.py [--impl PATH] [--runs 3]

Starts a listener (this process) and two peers under `mpiexec -n 1` that send and receive without
pause; the listener sends to and receives from both in a thread each. After 3 s the first peer's
process group is SIGKILLed. Prints, per run, the seconds from the kill until the listener declared
each peer gone (null: not within 15 s), why, and the longest send+receive call on the surviving
channel; last line one JSON object. The survivor must stay connected (its listener silent for
less than its 5 s timeout) and the dead peer must be declared gone.
"""

import argparse
import faulthandler
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gyre.common import jsonio
from gyre.control import messages as m
from gyre.control.transport import ChannelClosed, ChannelTimeout
from tools.probe.mpi_stress import _load

BEAT_S, TIMEOUT_S = 0.2, 5.0


def peer(mpi, port_file: str) -> None:
    ch = mpi.mpi_connect(port_file, timeout_s=30, heartbeat_s=BEAT_S, peer_timeout_s=TIMEOUT_S)
    while True:
        ch.send(m.WeightVersion(1))
        try:
            ch.recv(timeout_s=0.01)
        except ChannelTimeout:
            pass


def one_run(mpi, impl: str | None) -> dict:
    port_file = os.path.join(tempfile.mkdtemp(), "kill.port")
    listener = mpi.MpiListener(port_file, heartbeat_s=BEAT_S, peer_timeout_s=TIMEOUT_S)
    cmd = [str(Path(sys.executable).with_name("mpiexec")), "-n", "1", sys.executable, __file__, "--peer", port_file]
    cmd += ["--impl", impl] if impl else []
    victim, survivor = (subprocess.Popen(cmd, start_new_session=True) for _ in range(2))
    channels = [listener.accept(timeout_s=60) for _ in range(2)]
    worst, gone, killed_at = [0.0, 0.0], [None, None], []

    def serve(i: int) -> None:
        while True:
            t = time.monotonic()
            try:
                channels[i].send(m.WeightVersion(2))
                try:
                    channels[i].recv(timeout_s=0.02)
                except ChannelTimeout:
                    pass
            except ChannelClosed as e:
                gone[i] = (round(time.monotonic() - killed_at[0], 2) if killed_at else None, str(e).splitlines()[0])
                return
            worst[i] = max(worst[i], time.monotonic() - t)

    for i in range(2):
        threading.Thread(target=serve, args=(i,), daemon=True).start()
    time.sleep(3)
    killed_at.append(time.monotonic())
    os.killpg(victim.pid, signal.SIGKILL)
    time.sleep(15)
    survivor_alive = survivor.poll() is None
    os.killpg(survivor.pid, signal.SIGKILL)
    dead = [i for i in range(2) if gone[i] is not None]
    return {
        "gone_after_s": [g[0] for g in gone if g],
        "why": [g[1] for g in gone if g],
        "survivor_alive": survivor_alive and len(dead) == 1,
        "longest_call_s_survivor": round(worst[1 - dead[0]] if len(dead) == 1 else max(worst), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", help="another gyre/control/mpi.py to test")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    faulthandler.enable()
    mpi = _load(args.impl)
    if args.peer:
        peer(mpi, args.peer)
        return
    runs = []
    for k in range(args.runs):
        runs.append(one_run(mpi, args.impl))
        print(f"run {k + 1}: {runs[-1]}", flush=True)
    ok = sum(r["survivor_alive"] and len(r["gone_after_s"]) == 1 for r in runs)
    print(jsonio.dumps({"impl": args.impl or "gyre/control/mpi.py", "runs": len(runs), "ok": ok}))
    os._exit(0)  # the listener's channel to the dead peer is not ours to finalise


if __name__ == "__main__":
    main()
