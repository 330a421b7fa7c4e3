"""Check packed micro-batches before training (pure): reject what cannot be trained, with a reason.

Structural faults (arrays that do not line up, bad boundaries, token ids out of the vocabulary)
make the whole batch unusable and raise BatchError. Faults of one sequence (its log-probs
misaligned with its targets, no targets at all) exclude only that sequence; the rest trains and
the per-reason counts go to the metrics.
"""

from collections import Counter
from dataclasses import replace

import torch

from gyre.errors import GyreError
from gyre.trajectory.sample import PackedBatch

_PER_TOKEN = ("position_ids", "target_mask", "behaviour_logprobs", "loss_weights", "advantages", "weight_versions")


class BatchError(GyreError):
    """A packed batch that cannot be trained at all; the message says why."""


def check_structure(batch: PackedBatch, vocab_size: int) -> None:
    """Raise BatchError unless every per-token array lines up with `tokens` and boundaries are sane."""
    if not isinstance(batch, PackedBatch):
        raise BatchError(f"expected a PackedBatch, got {type(batch).__name__}")
    t = batch.num_tokens
    if batch.tokens.dim() != 1 or t == 0:
        raise BatchError(f"tokens must be a non-empty 1-D tensor, got shape {tuple(batch.tokens.shape)}")
    for name in _PER_TOKEN:
        shape = tuple(getattr(batch, name).shape)
        if shape != (t,):
            raise BatchError(f"{name} has shape {shape}, expected ({t},) like tokens")
    for name, ok in (
        ("tokens", _is_int),
        ("position_ids", _is_int),
        ("weight_versions", _is_int),
        ("behaviour_logprobs", torch.is_floating_point),
        ("loss_weights", torch.is_floating_point),
        ("advantages", torch.is_floating_point),
        ("target_mask", lambda x: x.dtype == torch.bool),
    ):
        if not ok(getattr(batch, name)):
            raise BatchError(f"{name} has dtype {getattr(batch, name).dtype}; see gyre/trajectory/sample.py")
    cu = batch.cu_seqlens.tolist()
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != t or any(b <= a for a, b in zip(cu, cu[1:])):
        raise BatchError(f"cu_seqlens must rise strictly from 0 to {t}, got {cu}")
    if len(batch.execution_ids) != len(cu) - 1:
        raise BatchError(f"{len(cu) - 1} sequences but {len(batch.execution_ids)} execution_ids")
    if int(batch.tokens.min()) < 0 or int(batch.tokens.max()) >= vocab_size:
        raise BatchError(
            f"token ids must lie in [0, {vocab_size}), got [{int(batch.tokens.min())}, {int(batch.tokens.max())}]"
        )


def _is_int(x: torch.Tensor) -> bool:
    return not torch.is_floating_point(x) and x.dtype != torch.bool


def sequence_fault(batch: PackedBatch, start: int, end: int) -> str | None:
    """Why sequence tokens[start:end] cannot be trained, or None. Reasons are short metric keys."""
    m = batch.target_mask[start:end]
    lp = batch.behaviour_logprobs[start:end]
    if not bool(m.any()) or float(batch.loss_weights[start:end][m].abs().sum()) == 0.0:
        return "empty_targets"
    if bool(m[0]):
        return "target_at_sequence_start"  # nothing predicts a sequence's first token
    if bool((lp[~m] != 0).any()):
        return "logprobs_misaligned"  # a log-prob outside the targets: shifted or mis-masked
    if not bool(torch.isfinite(lp[m]).all()) or bool((lp[m] > 0).any()):
        return "logprobs_invalid"
    if bool((batch.weight_versions[start:end][m] < 0).any()):
        return "weight_version_missing"
    if bool((batch.position_ids[start:end] != torch.arange(end - start)).any()):
        return "positions_not_restarting"
    return None


def screen_batch(batch: PackedBatch, vocab_size: int) -> tuple[PackedBatch, Counter, list[tuple[str, str]]]:
    """Drop the sequences that cannot be trained.

    Returns:
        (the batch without them, counts per reason, [(execution_id, reason)] of each dropped one)
    Raises:
        BatchError: a structural fault, or no sequence is left (the reasons are listed).
    """
    check_structure(batch, vocab_size)
    cu = batch.cu_seqlens.tolist()
    keep, rejected = [], []
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        reason = sequence_fault(batch, a, b)
        if reason is None:
            keep.append(i)
        else:
            rejected.append((batch.execution_ids[i], reason))
    counts = Counter(r for _, r in rejected)
    if not keep:
        raise BatchError(f"no trainable sequence in the batch: {dict(counts)}")
    if not rejected:
        return batch, counts, rejected
    return select_sequences(batch, keep), counts, rejected


def select_sequences(batch: PackedBatch, indices: list[int]) -> PackedBatch:
    """A packed batch holding only the given sequences, in order."""
    cu = batch.cu_seqlens.tolist()
    spans = [torch.arange(cu[i], cu[i + 1]) for i in indices]
    idx = torch.cat(spans)
    lengths = torch.tensor([0] + [cu[i + 1] - cu[i] for i in indices])
    fields = {name: getattr(batch, name)[idx] for name in ("tokens",) + _PER_TOKEN}
    return replace(
        batch,
        **fields,
        cu_seqlens=torch.cumsum(lengths, 0).to(torch.int32),
        execution_ids=tuple(batch.execution_ids[i] for i in indices),
    )
