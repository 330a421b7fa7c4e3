"""Checkpoints of the core cell: megatron dist_checkpointing for model and optimizer, plus the
coordinator's resume state, written atomically with keep-last-N.

Layout under `root`:
    step_00000012/          a complete checkpoint (dist_checkpointing files + gyre_state.json)
    .tmp-step_00000013/     a save in progress or interrupted; never loaded, removed by the next save

A save writes into the temp directory on every rank, then rank 0 renames it into place (atomic on
one filesystem) and deletes the oldest complete checkpoints beyond `keep_last`. A crash at any
point leaves the previous complete checkpoint untouched and loadable.
"""

import os
import queue
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from gyre.common import jsonio
from gyre.common.files import publish
from gyre.errors import GyreError

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_STATE_FILE = "gyre_state.json"


class CheckpointError(GyreError):
    """A checkpoint cannot be written or read; names the path."""


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first (pure directory listing)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), root / p.name) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


class CheckpointManager:
    """Save and restore a Trainer (model, optimizer, step, RNG) and an opaque coordinator state."""

    def __init__(self, root: str | os.PathLike, keep_last: int):
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, trainer, extra_state: dict | None = None) -> Path:
        """Checkpoint `trainer` at its current step; `extra_state` must be JSON-serialisable.

        Returns:
            The complete checkpoint directory.
        """
        from megatron.core import dist_checkpointing

        _writer_results_in_process()
        rank0 = dist.get_rank() == 0
        final = self.root / f"step_{trainer.step:08d}"
        tmp = self.root / f".tmp-{final.name}"
        if rank0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        dist.barrier()
        dist_checkpointing.save(self._sharded_state(trainer), str(tmp))
        dist.barrier()
        if rank0:
            state = {"step": trainer.step, "extra": extra_state or {}}
            _write_synced(tmp / _STATE_FILE, jsonio.dumps(state).encode())
            if final.exists():  # re-saving a step (after a resume): replace it
                shutil.rmtree(final)
            publish(tmp, final, fsync=True)
            for _, old in list_checkpoints(self.root)[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def load_latest(self, trainer) -> dict | None:
        """Restore the newest complete checkpoint into `trainer`; None if there is none.

        Returns:
            The coordinator state saved with it (`extra_state`).
        """
        found = list_checkpoints(self.root)
        return self.load(trainer, found[-1][1]) if found else None

    def load(self, trainer, path: str | os.PathLike) -> dict:
        """Restore the checkpoint at `path` into `trainer` (same TP size or resharded by Megatron)."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        if not (path / _STATE_FILE).is_file():
            raise CheckpointError(f"{path} is not a complete checkpoint (no {_STATE_FILE})")
        state = jsonio.loads((path / _STATE_FILE).read_text())
        local = trainer.local_optimizer
        _init_optimizer_state(local)
        loaded = dist_checkpointing.load(self._sharded_state(trainer), str(path))
        trainer.model.load_state_dict(loaded["model"], strict=False)
        optim = loaded["optimizer"]
        step_t = torch.tensor(float(loaded["optimizer_step"]))
        for pid in optim["state"]:
            optim["state"][pid]["step"] = step_t.clone()
        # the groups (hyper-parameters, parameter ids) are common state, saved by rank 0: this rank's own
        optim["param_groups"] = local.state_dict()["param_groups"]
        local.load_state_dict(optim)
        torch.set_rng_state(loaded["rng"])
        trainer.step = int(state["step"])
        return state["extra"]

    @staticmethod
    def _sharded_state(trainer) -> dict:
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        model_sd = trainer.model.sharded_state_dict(prefix="")
        local = trainer.local_optimizer
        _init_optimizer_state(local)
        optim_sd = local.state_dict()
        steps = {float(s["step"]) for s in optim_sd["state"].values()}
        owned = [p for group in local.param_groups for p in group["params"]]
        id_map = get_param_id_to_sharded_param_map(model_sd, owned)
        optim_state_to_sharding_state(optim_sd, id_map, exclude_keys=("step",))
        if local is not trainer.optimizer:  # sharded over data parallel: the owner's moments are the main replica
            for state in optim_sd["state"].values():
                for tensor in state.values():
                    tensor.replica_id = (*tensor.replica_id[:-1], 0)
        return {
            "model": model_sd,
            "optimizer": optim_sd,
            "optimizer_step": steps.pop() if steps else 0.0,
            "rng": torch.get_rng_state(),
        }


def _writer_results_in_process() -> None:
    """megatron's checkpoint writer hands its results over a queue it would keep in a spawned Manager
    process, for saves run in the background by another process. Gyre saves synchronously: the
    writer runs in this process, so an in-process queue carries them. No Manager to start (it
    re-imports this process's main module: ~7 s of CPU at the first save here) and none to orphan
    when the saving process dies at once (SIGKILL, a lost rank's os._exit)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter Adam state (zeros, step 0) so a fresh optimizer can be saved or loaded into."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
