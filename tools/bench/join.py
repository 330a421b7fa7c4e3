"""Benchmark: a satellite cell's join time (weight pull + first micro-step) at 1, 2 and 4 ranks per
cell, the same model each time, side by side in one run.

    PYTHONPATH=. python tools/bench/join.py [--ranks 1 2 4] [--pulls 5] [--hidden 512] [--layers 4] [--smoke]

For each rank count R this script starts a core cell and a satellite cell of R ranks each (tensor
parallel R: each rank holds 1/R of the model, gyre/train/shard.py), both on this machine. The core
opens a step of one micro-batch it does not compute itself; the satellite joins (Join/Welcome),
pulls its weights rank to rank over Mooncake and computes that micro-step, writing its gradient
shards back. Timed on the satellite's rank 0:
  join_s: from before the Join to the first micro-step's Done (registration, pull, forward,
          backward and the gradient write);
  pull_s: the median of --pulls weight pulls (the first one, inside the join, included): from the
          Pull request to every rank's shard in.
Shards move in parallel, so with enough cores the pull does not grow with R; on a box with fewer
cores than 2 R ranks they compete for CPU (the load is printed). Prints figures, then one JSON
object on the last line. --smoke (the test suite's run): one rank per cell, a 64-wide one-layer
model, two pulls.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gyre.common import jsonio

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"


def _model(args):
    from gyre.models.config import ModelConfig

    return ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=3 * args.hidden,
        num_attention_heads=8,
        num_query_groups=4,
        vocab_size=8192,
        max_seq_len=256,
    )


def _batch(model):
    """One micro-batch: two sequences of 64 tokens, every token after the first a target."""
    import torch

    from gyre.trajectory.sample import PackedBatch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (128,), generator=g)
    positions = torch.arange(64).repeat(2)
    target = positions > 0
    return PackedBatch(
        tokens=tokens,
        position_ids=positions,
        cu_seqlens=torch.tensor([0, 64, 128], dtype=torch.int32),
        target_mask=target,
        behaviour_logprobs=torch.where(target, -torch.rand(128, generator=g) * 8 - 0.5, 0.0),
        loss_weights=target.float(),
        advantages=torch.where(target, torch.tensor([1.0] * 64 + [-1.0] * 64), 0.0),
        weight_versions=torch.where(target, 0, -1),
        execution_ids=("e0", "e1"),
    )


def _lost(rank: int, code: int) -> None:
    print(f"rank {rank} exited with code {code}", file=sys.stderr, flush=True)
    os._exit(1)


def _cell(args, log_dir: str):
    """This process as rank 0 of a cell of args.ranks ranks (tensor parallel): (trainer, its CellRanks)."""
    import torch

    from gyre.common.ports import PortReservation
    from gyre.train.config import TrainerConfig
    from gyre.train.ranks import CellRanks, start_followers
    from gyre.train.trainer import Trainer

    torch.set_num_threads(1)
    model, cfg = _model(args), TrainerConfig(tensor_parallel_size=args.ranks, core_computes_microsteps=False)
    with PortReservation() as master_port:  # until the trainer's group store binds it
        followers = start_followers(args.ranks, HOST, master_port, model, cfg, 0, log_dir) if args.ranks > 1 else []
        trainer = Trainer(model, cfg, seed=0)
    return trainer, CellRanks(trainer, followers, _lost)


def run_core(args) -> None:
    """Open a step of one micro-batch, print the address, serve until stdin closes."""
    from gyre.train.elastic import CoreServer
    from gyre.transfer import TransferEndpoint

    trainer, ranks = _cell(args, args.log_dir)
    server = CoreServer(trainer, TransferEndpoint(HOST), HOST, ranks=ranks)
    server.begin_step()
    server.add_micro_batch(_batch(trainer.model_cfg))
    server.end_step()
    print(f"address {server.address}", flush=True)
    server.run_step()  # returns once the satellite's micro-step is folded and applied
    sys.stdin.read()
    server.close()
    ranks.stop()


def run_satellite(args) -> None:
    """Join, pull, compute the core's micro-step; pull again; print the times as JSON."""
    from gyre.train.satellite import SatelliteCell
    from gyre.transfer import TransferEndpoint

    trainer, ranks = _cell(args, args.log_dir)
    stop = threading.Event()
    t0 = time.perf_counter()
    sat = SatelliteCell(trainer, TransferEndpoint(HOST), args.core, "cell1", ranks=ranks, host=HOST)
    pulls = [sat.pull_latest()[1]]
    worker = threading.Thread(target=sat.serve, args=(stop,))
    worker.start()
    while sat.num_computed < 1:
        time.sleep(0.001)
    join_s = time.perf_counter() - t0
    stop.set()
    worker.join()
    pulls += [sat.pull_latest()[1] for _ in range(args.pulls - 1)]
    sat.close()
    ranks.stop()
    print(jsonio.dumps({"join_s": join_s, "pulls": pulls, "numel_per_rank": trainer.flat.weights.numel()}), flush=True)


def _spawn(role: str, args, extra: list[str], log_dir: str) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--role", role, "--ranks", str(args.ranks_now), "--log-dir", log_dir]
    cmd += ["--hidden", str(args.hidden), "--layers", str(args.layers), *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def measure(args, ranks: int) -> dict:
    """One core and one satellite of `ranks` ranks: the satellite's join and pull times."""
    args.ranks_now = ranks
    with tempfile.TemporaryDirectory() as log_dir:
        core = _spawn("core", args, [], log_dir)
        try:
            line = core.stdout.readline()
            if not line.startswith("address "):
                raise RuntimeError(f"the core of {ranks} ranks did not start: {line!r}")
            sat = _spawn("satellite", args, ["--core", line.split()[1], "--pulls", str(args.pulls)], log_dir)
            out, _ = sat.communicate(timeout=900)
            if sat.returncode:
                raise RuntimeError(f"the satellite of {ranks} ranks exited with {sat.returncode}")
            core.stdin.close()
            core.wait(timeout=120)
        finally:
            if core.poll() is None:
                core.kill()
    return jsonio.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--pulls", type=int, default=5, help="weight pulls per satellite (median reported)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--role", choices=["core", "satellite"], help=argparse.SUPPRESS)
    parser.add_argument("--core", help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="smallest sizes, seconds (the test suite's run)")
    args = parser.parse_args()
    if args.smoke:
        args.ranks, args.pulls, args.hidden, args.layers = [1], 2, 64, 1
    if args.role:
        args.ranks = args.ranks[0]
        (run_core if args.role == "core" else run_satellite)(args)
        return
    load0 = os.getloadavg()
    rows = {r: measure(args, r) for r in args.ranks}
    load1 = os.getloadavg()
    print(f"load average (1 min) before {load0[0]:.1f}, after {load1[0]:.1f}; {os.cpu_count()} CPUs")
    for r, row in rows.items():
        mb = row["numel_per_rank"] * 4 / 1e6
        print(
            f"ranks {r}: shard {mb:.1f} MB per rank, pull median {statistics.median(row['pulls']):.3f} s "
            f"(all {', '.join(f'{p:.3f}' for p in row['pulls'])}), join {row['join_s']:.3f} s"
        )
    print(
        jsonio.dumps(
            {
                "ranks": list(rows),
                "pull_s": [statistics.median(row["pulls"]) for row in rows.values()],
                "join_s": [row["join_s"] for row in rows.values()],
                "shard_mb": [row["numel_per_rank"] * 4 / 1e6 for row in rows.values()],
                "load_1min": [load0[0], load1[0]],
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
