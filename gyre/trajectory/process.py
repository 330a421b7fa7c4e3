"""From records and evaluations to weighted training samples: one execution, then one task group.

    records ─> call tree ─> paths ─> select K ─> per-path arrays ─> shared targets marked
    evaluation ─> reward ─┐                                            │
    group of executions ──┴─> GRPO advantages ─> loss weights ─> TrainingSample (pack.py packs)

Loss weights (config.averaging): `path` gives each unique target m/P (m = the selected paths that
have it, P = the execution's selected paths), so the loss is the mean over an execution's paths of
each path's summed loss: branching adds no weight, and a token's weight does not shrink as its
execution grows. `execution` gives each unique target 1/U (U = the execution's unique targets), so
every execution weighs 1 whatever its tokens; `token` gives each 1. The trainer divides the step's
weighted loss by the step's summed weights. Shared targets weigh 0 on later copies.

Why `path` is the default: under `execution`, a call every execution of a group makes alike
weighs 1/U in each, so when the failed executions are the short ones (on the toy they have half the
targets) its tokens get a net negative advantage step after step. Under `path` such weights are
equal whenever the executions' paths hold the call alike, as with Dr. GRPO's constant normaliser.
"""

import logging
from collections import Counter
from dataclasses import dataclass, field, fields

import numpy as np

from gyre.records.io import common_prefix_len
from gyre.records.record import CallRecord
from gyre.trajectory.config import TrajectoryConfig
from gyre.trajectory.paths import PathSample, make_path_sample, make_paths, mark_shared_targets, select_paths
from gyre.trajectory.rewards import Evaluation, group_advantages, reward_of
from gyre.trajectory.tree import TrajectoryError, build_call_tree

log = logging.getLogger(__name__)


@dataclass
class TokenCounts:
    """Tokens to train (targets) and to compute (sequence tokens), naive vs capped vs deduplicated."""

    targets_naive: int = 0
    """Targets over every trainable path, each path its own sample (no cap, no dedup)."""
    targets_capped: int = 0
    """Targets over the selected (at most K) paths."""
    targets_dedup: int = 0
    """Unique targets over the selected paths: what the loss counts."""
    seq_tokens_naive: int = 0
    seq_tokens_capped: int = 0
    seq_tokens_packed: int = 0
    """Sequence tokens actually packed (selected paths with at least one unique target)."""
    seq_tokens_tree: int = 0
    """Distinct token-tree nodes of the selected paths: what prefix-tree packing would compute."""

    def __iadd__(self, other: "TokenCounts") -> "TokenCounts":
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self


@dataclass
class ExecutionResult:
    execution_id: str
    samples: list[PathSample]
    excluded: str | None = None
    """Why the whole execution is not trained (missing_call, no_trainable_path), or None."""
    left_out: Counter = field(default_factory=Counter)
    """Paths not trained, by reason (auxiliary, duplicate, over_cap, fully_shared)."""
    num_paths: int = 0
    """Selected paths, fully shared ones included (P of `path` averaging)."""
    counts: TokenCounts = field(default_factory=TokenCounts)
    num_missing_calls: int = 0


@dataclass(frozen=True)
class TrainingSample:
    """A path with what the loss needs: per-token weights and the execution's advantage."""

    path: PathSample
    loss_weights: np.ndarray
    """float32, non-zero exactly on unique targets."""
    advantage: float


@dataclass
class GroupResult:
    samples: list[TrainingSample]
    excluded: Counter = field(default_factory=Counter)
    """Executions not trained, by reason."""
    excluded_executions: list[tuple[str | None, str]] = field(default_factory=list)
    """(execution id, reason) of each execution not trained (id None when it had no records)."""
    left_out: Counter = field(default_factory=Counter)
    counts: TokenCounts = field(default_factory=TokenCounts)
    rewards: dict[str, float] = field(default_factory=dict)
    advantages: dict[str, float] = field(default_factory=dict)


def process_execution(records: list[CallRecord], config: TrajectoryConfig) -> ExecutionResult:
    """Selected, deduplicated path samples of one execution.

    Raises:
        TrajectoryError: records that contradict each other (see build_call_tree).
    """
    tree = build_call_tree(records)
    result = ExecutionResult(execution_id=tree.execution_id, samples=[], num_missing_calls=len(tree.missing_seqs))
    if tree.missing_seqs and not config.allow_missing_calls:
        result.excluded = "missing_call"
        return result
    paths = make_paths(tree)
    selected, result.left_out = select_paths(paths, config.max_paths)
    if not selected:
        result.excluded = "no_trainable_path"
        return result
    samples = [make_path_sample(tree, p) for p in selected]
    mark_shared_targets(samples)
    result.num_paths = len(samples)
    c = result.counts
    trainable = [p for p in paths if p.excluded is None]
    c.targets_naive = sum(p.num_targets for p in trainable)
    c.seq_tokens_naive = sum(p.num_tokens for p in trainable)
    c.targets_capped = sum(p.num_targets for p in selected)
    c.seq_tokens_capped = sum(p.num_tokens for p in selected)
    c.targets_dedup = sum(int(s.unique_mask.sum()) for s in samples)
    c.seq_tokens_tree = _tree_nodes(samples)
    result.samples = [s for s in samples if s.unique_mask.any()]
    if len(result.samples) < len(samples):
        result.left_out["fully_shared"] += len(samples) - len(result.samples)
    c.seq_tokens_packed = sum(s.tokens.size for s in result.samples)
    return result


def _tree_nodes(samples: list[PathSample]) -> int:
    """Distinct token-tree nodes: each sequence minus its longest common prefix with an earlier one."""
    total = 0
    for k, s in enumerate(samples):
        shared = max((common_prefix_len(s.tokens, e.tokens) for e in samples[:k]), default=0)
        total += s.tokens.size - shared
    return total


def weight_samples(result: ExecutionResult, advantage: float, config: TrajectoryConfig) -> list[TrainingSample]:
    """Loss weights of one execution's samples under config.averaging (see module doc)."""
    if config.averaging == "path":
        weights = [s.copies.astype(np.float32) / np.float32(result.num_paths) for s in result.samples]
    else:
        num_unique = sum(int(s.unique_mask.sum()) for s in result.samples)
        scale = np.float32(1.0 / num_unique if config.averaging == "execution" else 1.0)
        weights = [s.unique_mask.astype(np.float32) * scale for s in result.samples]
    return [TrainingSample(path=s, loss_weights=w, advantage=advantage) for s, w in zip(result.samples, weights)]


def process_group(executions: list[tuple[list[CallRecord], Evaluation]], config: TrajectoryConfig) -> GroupResult:
    """Training samples of one task group; every execution left out is counted by reason.

    Reasons: the evaluation's (evaluator_error, budget_exhausted, no_score), the records'
    (bad_records, missing_call, no_trainable_path), the group's (group_too_small, uniform_group).
    """
    group = GroupResult(samples=[])
    valid: dict[str, ExecutionResult] = {}
    for records, evaluation in executions:
        reward, reason = reward_of(evaluation)
        if reason is None:
            try:
                result = process_execution(records, config)
            except TrajectoryError as e:
                log.warning("execution excluded (bad_records): %s", e)
                reason = "bad_records"
            else:
                reason = result.excluded
                group.left_out += result.left_out
        if reason is not None:
            group.excluded[reason] += 1
            group.excluded_executions.append((records[0].execution_id if records else None, reason))
            continue
        if result.execution_id in valid:
            raise TrajectoryError(f"execution {result.execution_id!r} appears twice in one group")
        valid[result.execution_id] = result
        group.rewards[result.execution_id] = reward
    group.advantages, reason = group_advantages(group.rewards, config)
    if reason is not None:
        group.excluded[reason] += len(valid)
        group.excluded_executions.extend((eid, reason) for eid in valid)
        return group
    for eid, result in valid.items():
        group.counts += result.counts
        group.samples.extend(weight_samples(result, group.advantages[eid], config))
    return group
