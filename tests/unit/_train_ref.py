"""Test helpers for gyre/train: pack sequences into the processor's PackedBatch, synthetic batches."""

import torch

from gyre.models.config import ModelConfig
from gyre.trajectory.sample import PackedBatch


def pack(seqs: list[dict]) -> PackedBatch:
    """Pack sequences {prompt, output, logprobs, advantage, weight=1, version=0, id} into one row."""
    cols = {k: [] for k in ("tokens", "pos", "mask", "blp", "w", "adv", "ver")}
    cu = [0]
    for s in seqs:
        n_p, n_o = len(s["prompt"]), len(s["output"])
        cols["tokens"] += list(s["prompt"]) + list(s["output"])
        cols["pos"] += list(range(n_p + n_o))
        cols["mask"] += [False] * n_p + [True] * n_o
        cols["blp"] += [0.0] * n_p + list(s["logprobs"])
        cols["w"] += [0.0] * n_p + [s.get("weight", 1.0)] * n_o
        cols["adv"] += [0.0] * n_p + [s["advantage"]] * n_o
        cols["ver"] += [-1] * n_p + [s.get("version", 0)] * n_o
        cu.append(cu[-1] + n_p + n_o)
    return PackedBatch(
        tokens=torch.tensor(cols["tokens"], dtype=torch.int64),
        position_ids=torch.tensor(cols["pos"], dtype=torch.int64),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        target_mask=torch.tensor(cols["mask"], dtype=torch.bool),
        behaviour_logprobs=torch.tensor(cols["blp"], dtype=torch.float32),
        loss_weights=torch.tensor(cols["w"], dtype=torch.float32),
        advantages=torch.tensor(cols["adv"], dtype=torch.float32),
        weight_versions=torch.tensor(cols["ver"], dtype=torch.int64),
        execution_ids=tuple(s.get("id", f"e{i}") for i, s in enumerate(seqs)),
    )


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
        out.append(pack(seqs))
    return out
