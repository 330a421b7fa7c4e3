"""Property tests on random executions (turns, sub-agents, rewinds mid-output, re-sends, summaries,
auxiliary calls), checked against an oracle on the token tree: a position of a sequence is a policy
token iff some kept call sampled that very token after that very prefix."""

import dataclasses
import os
import tempfile
from collections import Counter
from functools import partial

import numpy as np
from _synthetic import SyntheticExecution, Thread
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gyre.records import RecordWriter, read_records
from gyre.trajectory.config import TrajectoryConfig
from gyre.trajectory.pack import pack
from gyre.trajectory.paths import make_path_sample, make_paths, select_paths
from gyre.trajectory.process import process_execution, weight_samples
from gyre.trajectory.tree import build_call_tree

OPS = ("turn", "turn", "turn", "turn", "new_main", "new_sub", "rewind", "resend", "summary", "aux")
PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def executions(draw):
    """(records, kept call ids): kept = every call but auxiliary ones and discarded first attempts."""
    ex = SyntheticExecution("prop", seed=draw(st.integers(0, 2**31)))
    threads = [Thread(ex, "main", None, ex.context(draw(st.integers(1, 6))))]
    threads[0].turn(draw(st.integers(0, 6)), draw(st.integers(0, 5)))
    discarded = set()
    for op in draw(st.lists(st.sampled_from(OPS), min_size=1, max_size=24)):
        t = threads[draw(st.integers(0, len(threads) - 1))]
        n_out, n_ctx = draw(st.integers(0, 6)), draw(st.integers(0, 5))
        if op == "turn":
            t.turn(n_out, n_ctx)
        elif op == "new_main":
            threads.append(Thread(ex, "main", None, ex.context(n_ctx + 1)))
        elif op == "new_sub":
            threads.append(Thread(ex, f"s{len(threads)}", t.agent_id, ex.context(n_ctx + 1)))
        elif op == "rewind":  # the harness edits its context: cut anywhere, even inside an output
            cut = draw(st.integers(1, t.tokens.size))
            threads.append(
                Thread(ex, t.agent_id, t.parent_agent_id, np.concatenate((t.tokens[:cut], ex.context(n_ctx + 1))))
            )
        elif op == "resend":  # broken stream: the first attempt is thrown away, the same input re-sent
            discarded.add(ex.call(t.agent_id, t.parent_agent_id, t.tokens, ex.policy(n_out)).call_id)
            t.turn(draw(st.integers(0, 6)), n_ctx, is_retry=True)
        elif op == "summary":
            t.summarize(n_ctx + 1, n_out)
        else:
            ex.call(t.agent_id, t.parent_agent_id, ex.context(n_ctx + 1), ex.policy(n_out), kind="auxiliary")
    kept = {r.call_id for r in ex.records if r.kind_hint != "auxiliary" and r.call_id not in discarded}
    return ex.records, kept


def _key(tokens: np.ndarray, t: int) -> bytes:
    return np.ascontiguousarray(tokens[: t + 1], dtype=np.int32).tobytes()


def _policy_keys(records, only=None):
    """key -> log-probs with which some call sampled that token after that prefix."""
    keys: dict[bytes, set] = {}
    for r in records:
        if only is not None and r.call_id not in only:
            continue
        seq = np.concatenate((r.input_ids, r.output_ids))
        for j in range(r.output_ids.size):
            keys.setdefault(_key(seq, r.input_ids.size + j), set()).add(float(r.logprobs[j]))
    return keys


def _loss(key: bytes) -> float:
    """A per-token loss that, like a causal model's, depends only on the prefix and the token."""
    return (hash(key) % 1000) / 1000.0


@PROPS
@given(executions())
def test_masks_equal_the_token_tree_truth_and_no_target_is_dropped(execution):
    records, kept = execution
    kept_keys = _policy_keys(records, kept)
    result = process_execution(records, TrajectoryConfig(max_paths=10_000))
    assert result.excluded in (None, "no_trainable_path")
    unique = Counter()
    for s in result.samples:
        truth = np.array([_key(s.tokens, t) in kept_keys for t in range(s.tokens.size)])
        assert np.array_equal(s.target_mask, truth)  # masks cover exactly the policy tokens
        for t in np.flatnonzero(s.target_mask):
            assert float(s.logprobs[t]) in kept_keys[_key(s.tokens, t)]  # aligned with its sampler
        unique.update(_key(s.tokens, t) for t in np.flatnonzero(s.unique_mask))
    assert set(unique) == set(kept_keys)  # every kept call's every output token is trained ...
    assert all(n == 1 for n in unique.values())  # ... exactly once


@PROPS
@given(executions(), st.integers(1, 6), st.sampled_from(["path", "execution", "token"]))
def test_deduplicated_loss_equals_naive_per_path_loss(execution, k, averaging):
    """Naive: each selected path is its own sample. Under `path` averaging the execution's loss is
    the mean over its P selected paths of each path's summed loss; under `execution` and `token` a
    target found on m selected paths weighs 1/m per copy, and `execution` divides everything by the
    execution's distinct targets. The packed, deduplicated batch must give the same loss."""
    records, kept = execution
    kept_keys = _policy_keys(records, kept)
    all_keys = _policy_keys(records)
    config = TrajectoryConfig(max_paths=k, averaging=averaging)
    result = process_execution(records, config)
    assume(result.excluded is None)
    batch = pack(weight_samples(result, 1.0, config))
    packed_loss = 0.0
    cu = batch.cu_seqlens.tolist()
    for lo, hi in zip(cu, cu[1:]):
        tokens = batch.tokens[lo:hi].numpy()
        for t in np.flatnonzero(batch.target_mask[lo:hi].numpy()):
            assert _key(tokens, t) in all_keys  # never a non-policy token
            packed_loss += float(batch.loss_weights[lo + t]) * _loss(_key(tokens, t))
    tree = build_call_tree(records)
    selected, _ = select_paths(make_paths(tree), k)  # fully shared paths too: they are in P
    per_path = [
        [_key(s.tokens, t) for t in range(s.tokens.size) if _key(s.tokens, t) in kept_keys]
        for s in map(partial(make_path_sample, tree), selected)
    ]
    assert result.num_paths == len(per_path)
    copies = Counter(key for path in per_path for key in path)
    if averaging == "path":
        naive_loss = sum(_loss(key) for path in per_path for key in path) / len(per_path)
    else:
        scale = 1.0 / len(copies) if averaging == "execution" else 1.0
        naive_loss = sum(_loss(key) * scale / copies[key] for path in per_path for key in path)
    assert abs(packed_loss - naive_loss) < 1e-4 * max(1.0, abs(naive_loss))


@PROPS
@given(executions())
def test_prefixes_alone_give_the_same_tree(execution):
    records, _ = execution
    bare = [dataclasses.replace(r, kind_hint="unknown", agent_id="main", parent_agent_id=None) for r in records]
    hinted, unhinted = build_call_tree(records), build_call_tree(bare)
    assert [n.parent for n in hinted.nodes] == [n.parent for n in unhinted.nodes]
    assert [n.shared for n in hinted.nodes] == [n.shared for n in unhinted.nodes]


@settings(max_examples=25, deadline=None)
@given(executions())
def test_records_file_roundtrip(execution):
    records, _ = execution
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ex.jsonl")
        with RecordWriter(path, fsync=False) as w:
            for r in records:
                w.append(r)
        back, stats = read_records(path)
    assert stats.num_torn == 0 and not stats.invalid
    for a, b in zip(records, back, strict=True):
        assert a.call_id == b.call_id and np.array_equal(a.input_ids, b.input_ids)
        assert np.array_equal(a.output_ids, b.output_ids) and np.array_equal(a.logprobs, b.logprobs)
        assert a.version_spans == b.version_spans
