"""The ranks of one cell: its first rank drives, the others run the same trainer calls in lockstep.

    rank 0 (the cell's leader, its control endpoint)        ranks 1..n-1 (`follow`)
    CellRanks.call(op, *args) ──broadcast (op, args)──────>  OPS[op](trainer, *args)
    OPS[op](trainer, *args)    <──── collectives of op ────>  (TP all-gathers, DP gradient broadcasts)

    python -m gyre.train.ranks --model '{...}' --trainer '{...}' --seed N   (a follower; RANK etc. set)

A cell's trainer ranks form one torch.distributed group with megatron-core's tensor- and
data-parallel groups (gyre/train/model.py); every collective must be entered by every rank in the
same order, so rank 0 announces each operation that contains one before entering it. Pipeline
parallel is not built and was not tried on CPU: the trainer builds its model and step without
megatron-core's pipeline schedules, so a cell's layouts are tensor parallel
(`trainer.tensor_parallel_size`) and data parallel (the remaining ranks).

Not built yet (issue 27, items 2-4): satellites of several ranks, a serving engine per rank, and
finding a dead rank: a follower waits for the next announcement inside a gloo collective, so a cell
idle past the group's timeout (torch's default, 30 min) or with a dead rank fails only then.
"""

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading

import torch.distributed as dist

from gyre.common.serve import die_with_parent
from gyre.models.checkpoint import load_checkpoint
from gyre.models.config import ModelConfig
from gyre.train.checkpoint import CheckpointManager
from gyre.train.config import TrainerConfig
from gyre.train.trainer import Trainer


def _save(trainer: Trainer, root: str, keep_last: int, extra: dict | None) -> str:
    return str(CheckpointManager(root, keep_last).save(trainer, extra))


def _load_latest(trainer: Trainer, root: str, keep_last: int) -> dict | None:
    return CheckpointManager(root, keep_last).load_latest(trainer)


def _load_engine_dir(trainer: Trainer, path: str) -> None:
    trainer.load_engine_weights(load_checkpoint(path)[1])


OPS = {
    "load_engine_dir": _load_engine_dir,
    "logprobs": Trainer.logprobs,
    "step_screened": Trainer.step_screened,
    "engine_weights": Trainer.engine_weights,
    "save": _save,
    "load_latest": _load_latest,
}
"""What rank 0 may ask of every rank: name -> function(trainer, *args)."""


class CellRanks:
    """Rank 0's handle on its cell's ranks (with one rank, a plain call)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.num_ranks = dist.get_world_size()
        self._order = threading.Lock()  # the leader's thread and the step's worker: one announcement at a time
        if dist.get_rank() != 0:
            raise RuntimeError(f"CellRanks drives from rank 0; rank {dist.get_rank()} must follow()")

    def call(self, op: str, *args):
        """Run OPS[op] on every rank of the cell; returns rank 0's result."""
        fn = OPS[op]
        if self.num_ranks == 1:
            return fn(self.trainer, *args)
        with self._order:
            dist.broadcast_object_list([(op, args)], src=0)
            return fn(self.trainer, *args)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Release the followers (their `follow` returns). If an operation still holds the group past
        `timeout_s` (a rank died mid-collective), give up: the followers die with this process."""
        if self.num_ranks > 1 and self._order.acquire(timeout=timeout_s):
            try:
                dist.broadcast_object_list([None], src=0)
            finally:
                self._order.release()


def follow(trainer: Trainer) -> int:
    """On ranks 1..n-1: run what rank 0 announces until it stops; returns the operations run."""
    done = 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return done
        op, args = box[0]
        OPS[op](trainer, *args)
        done += 1


def start_followers(num_ranks: int, host: str, model: ModelConfig, cfg: TrainerConfig, seed: int, log_dir: str) -> list:
    """Spawn ranks 1..num_ranks-1 of this process's cell and make this process rank 0 (call before
    building its Trainer, whose init is the group's rendezvous). They die with this process.

    Returns:
        The followers' Popen objects (their output in `log_dir`/rank<r>.<pid>.log).
    """
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    group = {"WORLD_SIZE": str(num_ranks), "MASTER_ADDR": host, "MASTER_PORT": str(port)}
    os.environ.update(group | {"RANK": "0"})
    cmd = [sys.executable, "-m", "gyre.train.ranks", "--model", json.dumps(dataclasses.asdict(model))]
    cmd += ["--trainer", json.dumps(dataclasses.asdict(cfg)), "--seed", str(seed)]
    procs = []
    for rank in range(1, num_ranks):
        with open(os.path.join(log_dir, f"rank{rank}.{os.getpid()}.log"), "w") as log:
            env = os.environ | group | {"RANK": str(rank)}
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
            )
    return procs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a follower rank of a multi-rank cell")
    parser.add_argument("--model", required=True, help="ModelConfig fields as JSON")
    parser.add_argument("--trainer", required=True, help="TrainerConfig fields as JSON")
    parser.add_argument("--seed", type=int, required=True)
    args = parser.parse_args(argv)
    run_follower(ModelConfig(**json.loads(args.model)), TrainerConfig(**json.loads(args.trainer)), args.seed)
    return 0


def run_follower(model: ModelConfig, cfg: TrainerConfig, seed: int) -> int:
    """Be one follower rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT set) until rank 0 stops; returns the
    operations run. A spawned rank (`main`) and a Slurm task (gyre.cells.slurm) both come here."""
    import torch

    torch.set_num_threads(1)
    done = follow(Trainer(model, cfg, seed))
    dist.destroy_process_group()
    return done


if __name__ == "__main__":
    sys.exit(main())
