"""Paths through a call tree: classification, bounded selection, and per-token target arrays.

A path runs from a branch root to a leaf call (one not fully continued by a child); its tokens are
the leaf's input+output, and its targets are the output tokens of every call on the chain that the
next call kept (so every output token of a kept call is a target on at least one path). A path's
class is its leaf's: main, main_summary (a compaction summary closes a main segment), subagent,
subagent_summary; paths ending in an auxiliary call or a duplicate re-send, or without a single
target, are excluded.

Selected paths often share a prefix; a target shared with an earlier selected path (same token
after the same prefix, i.e. the same node of the token tree) is kept in both sequences for context
but marked not unique, so it contributes to the loss once.
"""

from collections import Counter
from dataclasses import dataclass

import numpy as np

from gyre.records.io import common_prefix_len
from gyre.trajectory.tree import CallTree, TrajectoryError

PATH_CLASSES = ("main", "main_summary", "subagent", "subagent_summary")
"""In selection priority order."""
_CLASS_OF_KIND = {
    "main": "main",
    "summary": "main_summary",
    "subagent": "subagent",
    "subagent_summary": "subagent_summary",
}


@dataclass(frozen=True)
class Path:
    """One root-to-leaf chain of calls (node indices into CallTree.nodes)."""

    chain: tuple[int, ...]
    path_class: str | None
    """One of PATH_CLASSES, or None when excluded."""
    excluded: str | None
    """Why the path is never trained (auxiliary, duplicate, no_targets), or None."""
    leaf_call_id: str
    leaf_seq: int
    agent_id: str
    spawned_by: str | None
    """Call id of the parent agent's call that spawned this path's agent (sub-agents only)."""
    num_tokens: int
    num_targets: int


@dataclass(frozen=True)
class PathSample:
    """One selected path as per-token arrays, aligned like PackedBatch (index t describes tokens[t])."""

    execution_id: str
    leaf_call_id: str
    path_class: str
    tokens: np.ndarray
    """int32 input+output of the leaf call."""
    target_mask: np.ndarray
    """bool: tokens[t] was sampled by the policy on this path's chain."""
    unique_mask: np.ndarray
    """bool: a target not already a target at the same token-tree node of an earlier selected path."""
    copies: np.ndarray
    """int32, on unique targets: how many selected paths have a target at this token-tree node (0 elsewhere)."""
    logprobs: np.ndarray
    """float32 behaviour log-prob of each target (0 elsewhere)."""
    versions: np.ndarray
    """int64 weight version of each target (-1 elsewhere)."""


def target_spans(tree: CallTree, chain: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(node, start, end): positions [start, end) of the path's sequence sampled by that node."""
    spans = []
    for depth, i in enumerate(chain):
        node = tree.nodes[i]
        limit = tree.nodes[chain[depth + 1]].shared if depth + 1 < len(chain) else node.end
        start = node.num_input
        end = min(node.end, limit)
        if end > start:
            spans.append((i, start, end))
    return spans


def make_paths(tree: CallTree) -> list[Path]:
    """Every leaf's path, classified, in leaf seq order."""
    paths = []
    for leaf, node in enumerate(tree.nodes):
        if tree.is_continued(leaf):
            continue
        chain = [leaf]
        while tree.nodes[chain[-1]].parent is not None:
            chain.append(tree.nodes[chain[-1]].parent)
        chain = tuple(reversed(chain))
        root = tree.nodes[chain[0]]
        num_targets = sum(e - s for _, s, e in target_spans(tree, chain))
        if node.duplicate_of is not None:
            excluded = "duplicate"
        elif node.kind == "auxiliary":
            excluded = "auxiliary"
        elif num_targets == 0:
            excluded = "no_targets"
        else:
            excluded = None
        spawner = tree.nodes[root.spawned_by].record.call_id if root.spawned_by is not None else None
        paths.append(
            Path(
                chain=chain,
                path_class=None if excluded else _CLASS_OF_KIND[node.kind],
                excluded=excluded,
                leaf_call_id=node.record.call_id,
                leaf_seq=node.record.seq,
                agent_id=node.record.agent_id,
                spawned_by=spawner,
                num_tokens=node.end,
                num_targets=num_targets,
            )
        )
    return paths


def select_paths(paths: list[Path], max_paths: int) -> tuple[list[Path], Counter]:
    """Up to max_paths trainable paths by class priority, latest leaf first within a class.

    Latest first: the final main path produced the evaluated workspace, and later paths of a
    class carry the execution's later progress. Returns the selection and a Counter of the
    reasons paths were left out (auxiliary, duplicate, over_cap).
    """
    left_out = Counter(p.excluded for p in paths if p.excluded is not None)
    eligible = [p for p in paths if p.excluded is None]
    eligible.sort(key=lambda p: (PATH_CLASSES.index(p.path_class), -p.leaf_seq))
    if len(eligible) > max_paths:
        left_out["over_cap"] += len(eligible) - max_paths
    return eligible[:max_paths], left_out


def make_path_sample(tree: CallTree, path: Path) -> PathSample:
    """Per-token arrays of one path.

    Raises:
        TrajectoryError: a target token differs from the output token it claims to be (never
            expected: the tree verifies matches; this guards against a silently misaligned sample).
    """
    leaf = tree.nodes[path.chain[-1]].record
    tokens = np.concatenate((leaf.input_ids, leaf.output_ids))
    mask = np.zeros(tokens.size, dtype=bool)
    logprobs = np.zeros(tokens.size, dtype=np.float32)
    versions = np.full(tokens.size, -1, dtype=np.int64)
    for i, start, end in target_spans(tree, path.chain):
        r = tree.nodes[i].record
        n = end - start
        if not np.array_equal(tokens[start:end], r.output_ids[:n]):
            raise TrajectoryError(
                f"path to {path.leaf_call_id}: tokens {start}..{end} differ from "
                f"the output of call {r.call_id} they were matched to"
            )
        mask[start:end] = True
        logprobs[start:end] = np.minimum(r.logprobs[:n], 0)  # records tolerate rounding just above 0
        versions[start:end] = r.output_versions()[:n]
    return PathSample(
        execution_id=tree.execution_id,
        leaf_call_id=path.leaf_call_id,
        path_class=path.path_class,
        tokens=tokens,
        target_mask=mask,
        unique_mask=mask.copy(),
        copies=mask.astype(np.int32),
        logprobs=logprobs,
        versions=versions,
    )


def mark_shared_targets(samples: list[PathSample]) -> None:
    """Clear unique_mask where an earlier sample already has a target at the same token-tree node,
    and count on the first copy how many samples have a target there (`copies`).

    Positions t < lcp(a, b) of two sequences are the same node (same token after the same prefix).
    """
    for k, s in enumerate(samples):
        for earlier in samples[:k]:
            n = common_prefix_len(s.tokens, earlier.tokens)
            if n:
                shared = s.unique_mask[:n] & earlier.target_mask[:n]
                s.unique_mask[:n] &= ~shared
                s.copies[:n][shared] = 0
                earlier.copies[:n] += shared & earlier.unique_mask[:n]
