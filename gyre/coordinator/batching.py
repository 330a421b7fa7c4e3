"""From a finished task group to the step's micro-batches (pure apart from reading records files).

    records files + evaluations ─> process_group ─> samples ─> staleness mask ─> micro-batches

The staleness rule is applied exactly as the simulator applies it (`trained_spans`): targets
sampled under a version older than `step - staleness` are masked out of the loss (they stay in
the sequence as context) and counted; an execution with no target left is dropped and counted.
With fixed batching and admission by `may_admit` nothing is ever masked; the mask is the check
that keeps it so whatever the batching.
"""

from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from gyre.records.io import RecordFileError, read_records
from gyre.records.versions import make_version_spans
from gyre.scheduler.streaming import trained_spans
from gyre.trajectory.config import TrajectoryConfig
from gyre.trajectory.pack import make_micro_batches
from gyre.trajectory.process import GroupResult, TokenCounts, TrainingSample, process_group
from gyre.trajectory.rewards import Evaluation
from gyre.trajectory.sample import PackedBatch


@dataclass
class GroupBatch:
    """One group's contribution to its step."""

    micro_batches: list[PackedBatch]
    rewards: dict[str, float]
    excluded: list[tuple[str, str]] = field(default_factory=list)
    """(execution id, reason) of every execution left out."""
    counts: TokenCounts = field(default_factory=TokenCounts)
    num_masked_targets: int = 0
    """Targets older than the staleness bound, masked out of the loss."""
    min_version: int | None = None
    """Oldest weight version among the trained targets."""


def mask_stale(sample: TrainingSample, step: int, staleness: int) -> tuple[TrainingSample | None, int]:
    """The sample with targets older than the bound masked (None if none is left), and how many were."""
    path = sample.path
    on = np.flatnonzero(path.target_mask)
    versions = path.versions[on]
    # Spans in order of position; the per-span rule keeps spans from the first in-bound version on.
    marks = [(s.version, s.start) for s in make_version_spans(versions)]
    kept = trained_spans(marks, len(versions), step, staleness)
    first = len(versions) if kept is None else kept[0]
    if first == 0:
        return sample, 0
    stale = on[:first]
    target_mask = path.target_mask.copy()
    target_mask[stale] = False
    weights = sample.loss_weights.copy()
    weights[stale] = 0.0
    logprobs, vers = path.logprobs.copy(), path.versions.copy()
    logprobs[stale], vers[stale] = 0.0, -1
    if not (weights > 0).any():
        return None, first
    new_path = replace(
        path, target_mask=target_mask, unique_mask=path.unique_mask & target_mask, logprobs=logprobs, versions=vers
    )
    return replace(sample, path=new_path, loss_weights=weights), first


def make_group_batch(
    executions: list[tuple[Path, Evaluation]],
    step: int,
    staleness: int,
    cfg: TrajectoryConfig,
    max_tokens: int,
    min_micro_batches: int = 1,
) -> GroupBatch:
    """Process one group's executions (records file, evaluation) for training at `step`, packed
    into micro-batches of at most `max_tokens`, at least `min_micro_batches` where it has the samples."""
    pairs, excluded = [], []
    for path, evaluation in executions:
        try:
            records, _ = read_records(path)
        except (OSError, RecordFileError):
            records = []
        if not records:
            excluded.append((path.stem, "no_records"))
            continue
        pairs.append((records, evaluation))
    result: GroupResult = process_group(pairs, cfg)
    excluded += [(eid or "?", reason) for eid, reason in result.excluded_executions]
    samples, masked, dropped = [], 0, Counter()
    for s in result.samples:
        kept, n = mask_stale(s, step, staleness)
        masked += n
        if kept is None:
            dropped[s.path.execution_id] += 1
        else:
            samples.append(kept)
    alive = {s.path.execution_id for s in samples}
    excluded += [(eid, "stale") for eid in dropped if eid not in alive]
    versions = [int(s.path.versions[s.path.target_mask].min()) for s in samples]
    return GroupBatch(
        micro_batches=make_micro_batches(samples, max_tokens, min_micro_batches) if samples else [],
        rewards={eid: r for eid, r in result.rewards.items()},
        excluded=excluded,
        counts=result.counts,
        num_masked_targets=masked,
        min_version=min(versions) if versions else None,
    )
