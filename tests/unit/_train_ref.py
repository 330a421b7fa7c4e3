"""Test helpers for gyre/train: sequences as the processor's samples, synthetic packed batches,
the environment of a two-rank gloo group."""

import os
from pathlib import Path

import numpy as np
import torch

from gyre.models.config import ModelConfig
from gyre.trajectory.pack import pack
from gyre.trajectory.paths import PathSample
from gyre.trajectory.process import TrainingSample
from gyre.trajectory.sample import PackedBatch


def as_samples(seqs: list[dict]) -> list[TrainingSample]:
    """Sequences {prompt, output, logprobs, advantage, weight=1, version=0, id} as the processor's
    samples, every output token a unique target, for the library's `pack`."""
    out = []
    for i, s in enumerate(seqs):
        n_p, n_o = len(s["prompt"]), len(s["output"])
        mask = np.array([False] * n_p + [True] * n_o)
        path = PathSample(
            execution_id=s.get("id", f"e{i}"),
            leaf_call_id=f"c{i}",
            path_class="main",
            tokens=np.array(list(s["prompt"]) + list(s["output"]), dtype=np.int32),
            target_mask=mask,
            unique_mask=mask,
            copies=mask.astype(np.int32),
            logprobs=np.array([0.0] * n_p + list(s["logprobs"]), dtype=np.float32),
            versions=np.array([-1] * n_p + [s.get("version", 0)] * n_o, dtype=np.int64),
        )
        weights = np.where(mask, np.float32(s.get("weight", 1.0)), np.float32(0))
        out.append(TrainingSample(path, weights, s["advantage"]))
    return out


def random_batches(
    cfg: ModelConfig, n_batches: int, seqs_per_batch: int, seed: int, max_len: int = 24
) -> list[PackedBatch]:
    """Synthetic micro-batches with plausible (negative) behaviour log-probs and mixed advantages."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        seqs = []
        for _ in range(seqs_per_batch):
            n_p = int(torch.randint(2, 8, (1,), generator=g))
            n_o = int(torch.randint(2, max_len - n_p, (1,), generator=g))
            seqs.append(
                {
                    "prompt": torch.randint(0, cfg.vocab_size, (n_p,), generator=g).tolist(),
                    "output": torch.randint(0, cfg.vocab_size, (n_o,), generator=g).tolist(),
                    "logprobs": (-torch.rand(n_o, generator=g) * 8 - 0.5).tolist(),
                    "advantage": float(torch.randn(1, generator=g)),
                }
            )
        out.append(pack(as_samples(seqs)))
    return out


def two_rank_env(master_port: int) -> dict[str, str]:
    """This process's environment for the ranks of a two-rank group whose rank 0 binds `master_port`
    (reserved: the `reserve_port` fixture; each rank adds its RANK), with the repository and
    tests/unit importable."""
    root = Path(__file__).resolve().parents[2]
    return dict(
        os.environ,
        PYTHONPATH=f"{root}:{root / 'tests/unit'}",
        OMP_NUM_THREADS="1",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
    )
