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


def make_micro_batches(samples: list[TrainingSample], max_tokens: int, min_rows: int = 1) -> list[PackedBatch]:
    """Pack samples into rows of at most max_tokens tokens: as few as first fit decreasing needs,
    but at least `min_rows` where there are that many samples, filled evenly. Each row is a
    micro-step that a training cell claims, and a step lasts as long as its busiest cell, so even
    rows finish together: a toy group of four ~2.4k-token paths under 8192 made rows of 7.4k and
    2.4k when filled in order, and makes two of 4.9k. `min_rows` is a training cell's
    data-parallel replicas: each computes a micro-step of its own, so a group that arrives alone
    busies every replica instead of one.

    Longest first into the emptiest row; should that overflow a row, the first-fit rows stand.
    Samples keep their order within a row, and rows the order of their first sample.

    Raises:
        TrajectoryError: a sample longer than max_tokens (raise the limit; it cannot be split).
    """
    sizes = [s.path.tokens.size for s in samples]
    for s, n in zip(samples, sizes):
        if n > max_tokens:
            raise TrajectoryError(
                f"path {s.path.leaf_call_id} of {s.path.execution_id} has {n} tokens, more than max_tokens={max_tokens}"
            )
    longest_first = sorted(range(len(samples)), key=lambda i: -sizes[i])
    rows = _fill(longest_first, sizes, max_tokens, None)
    num_rows = max(len(rows), min(min_rows, len(samples)))
    rows = _fill(longest_first, sizes, max_tokens, num_rows) or rows
    return [pack([samples[i] for i in sorted(r)]) for r in sorted(rows, key=min)]


def _fill(order: list[int], sizes: list[int], max_tokens: int, num_rows: int | None) -> list[list[int]] | None:
    """Indices in `order` placed into rows: first fit (`num_rows` None), or each into the
    emptiest of `num_rows` rows (None if one would exceed max_tokens)."""
    rows: list[list[int]] = [[] for _ in range(num_rows or 0)]
    used = [0] * len(rows)
    for i in order:
        if num_rows is None:
            k = next((k for k, u in enumerate(used) if u + sizes[i] <= max_tokens), len(rows))
            if k == len(rows):
                rows.append([])
                used.append(0)
        else:
            k = min(range(num_rows), key=lambda k: (used[k], k))
            if used[k] + sizes[i] > max_tokens:
                return None
        rows[k].append(i)
        used[k] += sizes[i]
    return rows
