"""Packing training samples into PackedBatch rows (the trainer's contract, see sample.py)."""

import numpy as np
import torch

from gyre.trajectory.process import TrainingSample
from gyre.trajectory.sample import PackedBatch
from gyre.trajectory.tree import TrajectoryError


def pack(samples: list[TrainingSample]) -> PackedBatch:
    """One row holding `samples` back to back, positions restarting at each sequence.

    Raises:
        TrajectoryError: no samples, or a target at a sequence's first token (it has no logits).
    """
    if not samples:
        raise TrajectoryError("nothing to pack: no samples")
    lengths = np.array([s.path.tokens.size for s in samples], dtype=np.int64)
    cu = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    if any(s.path.target_mask[0] for s in samples):
        raise TrajectoryError("a sample has a target at its first token, which no logits predict")
    positions = np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1], lengths)
    cat = np.concatenate
    mask = cat([s.path.target_mask for s in samples])
    advantages = cat([np.where(s.path.target_mask, np.float32(s.advantage), np.float32(0)) for s in samples])
    return PackedBatch(
        tokens=torch.from_numpy(cat([s.path.tokens for s in samples]).astype(np.int64)),
        position_ids=torch.from_numpy(positions),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        target_mask=torch.from_numpy(mask),
        behaviour_logprobs=torch.from_numpy(cat([s.path.logprobs for s in samples])),
        loss_weights=torch.from_numpy(cat([s.loss_weights for s in samples])),
        advantages=torch.from_numpy(advantages.astype(np.float32)),
        weight_versions=torch.from_numpy(cat([s.path.versions for s in samples])),
        execution_ids=tuple(s.path.execution_id for s in samples),
    )


def make_micro_batches(samples: list[TrainingSample], max_tokens: int) -> list[PackedBatch]:
    """Pack samples in order into rows of at most max_tokens tokens (first fit, order kept).

    Raises:
        TrajectoryError: a sample longer than max_tokens (raise the limit; it cannot be split).
    """
    rows: list[list[TrainingSample]] = []
    used: list[int] = []
    for s in samples:
        n = s.path.tokens.size
        if n > max_tokens:
            raise TrajectoryError(f"path {s.path.leaf_call_id} of {s.path.execution_id} has {n} tokens, "
                                  f"more than max_tokens={max_tokens}")
        for k, u in enumerate(used):
            if u + n <= max_tokens:
                rows[k].append(s)
                used[k] += n
                break
        else:
            rows.append([s])
            used.append(n)
    return [pack(r) for r in rows]
