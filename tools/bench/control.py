"""Benchmark: control-message round trip over the TCP and the MPI transport, side by side.

    PYTHONPATH=. python tools/bench/control.py [--repeats 2000] [--work-kib 64] [--smoke]

This process listens on each backend in turn; an echo peer (this script with --peer) connects,
under `mpiexec -n 1` for MPI (two MPICH singletons cannot connect). Timed: `Channel.request` of a
Heartbeat (a few hundred bytes pickled) and of a Work carrying a micro-batch of --work-kib KiB,
median over --repeats; CPU seconds of this process from /proc alongside. Prints figures, then one
JSON object on the last line. --smoke (the test suite's run): both backends, 20 round trips of a
4 KiB Work.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gyre.common import jsonio

ROOT = Path(__file__).resolve().parents[2]


def _work(kib: int):
    import torch

    from gyre.control.messages import Work
    from gyre.trajectory.sample import PackedBatch

    n = kib * 1024 // 41  # 41 bytes per token over the eight per-token arrays
    t = torch.arange(n)
    batch = PackedBatch(
        tokens=t,
        position_ids=t,
        cu_seqlens=torch.tensor([0, n], dtype=torch.int32),
        target_mask=t > 0,
        behaviour_logprobs=-t.float(),
        loss_weights=torch.ones(n),
        advantages=t.float(),
        weight_versions=t * 0,
        execution_ids=("e0",),
    )
    return Work(index=0, version=1, slot=0, batch=batch)


def _cpu_s() -> float:
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peer(address: str) -> None:
    from gyre.control.messages import Leave
    from gyre.control.transport import connect

    ch = connect(address)
    while not isinstance(msg := ch.recv(), Leave):
        ch.send(msg)
    ch.send(msg)
    ch.close()


def measure(backend: str, repeats: int, work_kib: int, tmp: str) -> dict:
    from gyre.control.messages import Heartbeat, Leave
    from gyre.control.transport import listen

    lst = listen(backend, port_file=os.path.join(tmp, "bench.port"))
    launcher = [str(Path(sys.executable).with_name("mpiexec")), "-n", "1"] if backend == "mpi" else []
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([*launcher, sys.executable, __file__, "--peer", lst.address], env=env)
    out = {}
    try:
        ch = lst.accept(timeout_s=120)
        for name, msg in (("heartbeat", Heartbeat("cell1", 1.0)), (f"work_{work_kib}kib", _work(work_kib))):
            for _ in range(20):
                ch.request(msg)  # warm up
            times, cpu0 = [], _cpu_s()
            for _ in range(repeats):
                t0 = time.perf_counter()
                ch.request(msg)
                times.append(time.perf_counter() - t0)
            out[f"{backend}/{name}_rtt_us"] = round(statistics.median(times) * 1e6, 1)
            out[f"{backend}/{name}_cpu_us_per_rtt"] = round((_cpu_s() - cpu0) / repeats * 1e6, 1)
        ch.request(Leave("bench"))
        ch.close()
    finally:
        proc.wait(timeout=60)
        lst.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", help="(internal) run the echo peer against this address")
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--work-kib", type=int, default=64)
    p.add_argument("--smoke", action="store_true", help="smallest sizes, seconds (the test suite's run)")
    args = p.parse_args()
    if args.smoke:
        args.repeats, args.work_kib = 20, 4
    if args.peer:
        return peer(args.peer)
    with tempfile.TemporaryDirectory() as tmp:
        report = measure("tcp", args.repeats, args.work_kib, tmp) | measure("mpi", args.repeats, args.work_kib, tmp)
    for k, v in report.items():
        print(f"{k:40s} {v}")
    for name in ("heartbeat", f"work_{args.work_kib}kib"):
        report[f"mpi_over_tcp/{name}_rtt"] = round(report[f"mpi/{name}_rtt_us"] / report[f"tcp/{name}_rtt_us"], 2)
    print(jsonio.dumps(report))


if __name__ == "__main__":
    main()
