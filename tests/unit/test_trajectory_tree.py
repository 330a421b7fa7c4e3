"""A hand-built execution with known answers: main + 2 compactions + nested sub-agents + a duplicate
re-send + an auxiliary call + a rewind, and the bad inputs the processor must refuse or count."""

import dataclasses
import random

import numpy as np
import pytest
from _synthetic import POLICY_LO, SyntheticExecution, Thread

from gyre.records import RecordWriter, read_records
from gyre.trajectory.config import TrajectoryConfig
from gyre.trajectory.paths import make_paths, select_paths
from gyre.trajectory.process import process_execution, process_group
from gyre.trajectory.rewards import Evaluation
from gyre.trajectory.tree import TrajectoryError, build_call_tree


def hand_built(execution_id="hand"):
    """Calls c0..c19; the comments give each call's expected parent."""
    ex = SyntheticExecution(execution_id, seed=1)
    system, task = ex.context(50), ex.context(10)
    ex.call("main", None, np.concatenate((ex.context(5), task)), ex.policy(4), kind="auxiliary")  # c0 title
    main = Thread(ex, "main", None, np.concatenate((system, task)))
    main.turn(8, 12)  # c1 root
    main.turn(8, 12)  # c2 <- c1, spawns sub-agent a
    a = Thread(ex, "a", "main", ex.context(30))
    a.turn(6, 10)  # c3 root (spawned by c2)
    a.turn(6, 10)  # c4 <- c3, spawns nested sub-agent b
    b = Thread(ex, "b", "a", ex.context(25))
    b.turn(5, 9)  # c5 root (spawned by c4)
    b.summarize(4, 7)  # c6 <- c5, sub-agent summary
    a.turn(6, 10, split_version=True)  # c7 <- c4
    main.turn(8, 12)  # c8 <- c2
    ex.call("main", None, main.tokens, ex.policy(5))  # c9 <- c8, stream broke: duplicate of c10
    main.turn(8, 12, is_retry=True)  # c10 <- c8, the harness's re-send
    main.turn(8, 12)  # c11 <- c10
    s1 = main.summarize(6, 15)  # c12 <- c11, compaction 1
    main = Thread(ex, "main", None, np.concatenate((system, task, s1.output_ids)))
    main.turn(8, 12)  # c13 root
    main.turn(8, 12)  # c14 <- c13
    s2 = main.summarize(6, 15)  # c15 <- c14, compaction 2
    main = Thread(ex, "main", None, np.concatenate((system, task, s2.output_ids)))
    main.turn(8, 12)  # c16 root
    rewound = Thread(ex, "main", None, np.concatenate((main.tokens[:-12], ex.context(3))))
    main.turn(8, 12)  # c17 <- c16, abandoned after a tool result was cleared
    rewound.turn(8, 12)  # c18 <- c16
    rewound.turn(8, 12)  # c19 <- c18, the final main call
    return ex.records


PARENTS = {
    1: None,
    2: 1,
    3: None,
    4: 3,
    5: None,
    6: 5,
    7: 4,
    8: 2,
    9: 8,
    10: 8,
    11: 10,
    12: 11,
    13: None,
    14: 13,
    15: 14,
    16: None,
    17: 16,
    18: 16,
    19: 18,
    0: None,
}


def _parents(tree):
    return {i: n.parent for i, n in enumerate(tree.nodes)}


def test_tree_parents_duplicates_and_lineage():
    tree = build_call_tree(hand_built())
    assert _parents(tree) == PARENTS
    assert [i for i, n in enumerate(tree.nodes) if n.duplicate_of is not None] == [9]
    assert tree.nodes[9].duplicate_of == 10
    assert tree.nodes[3].spawned_by == 2 and tree.nodes[5].spawned_by == 4
    assert [n.kind for n in tree.nodes][:7] == [
        "auxiliary",
        "main",
        "main",
        "subagent",
        "subagent",
        "subagent",
        "subagent_summary",
    ]


def test_tree_without_hints_has_the_same_shape():
    """No kind hints, no agent ids: the prefixes alone give the same parents and duplicate."""
    bare = [
        dataclasses.replace(r, kind_hint="unknown", agent_id="main", parent_agent_id=None, hints={}, is_retry=False)
        for r in hand_built()
    ]
    tree = build_call_tree(bare)
    assert _parents(tree) == PARENTS
    assert tree.nodes[9].duplicate_of == 10


def test_paths_classes_and_selection_in_priority_order():
    paths = make_paths(build_call_tree(hand_built()))
    by_leaf = {p.leaf_call_id: p for p in paths}
    assert {k: (p.path_class, p.excluded) for k, p in by_leaf.items()} == {
        "c0": (None, "auxiliary"),
        "c6": ("subagent_summary", None),
        "c7": ("subagent", None),
        "c9": (None, "duplicate"),
        "c12": ("main_summary", None),
        "c15": ("main_summary", None),
        "c17": ("main", None),
        "c19": ("main", None),
    }
    assert by_leaf["c19"].chain == (16, 18, 19) and by_leaf["c12"].chain == (1, 2, 8, 10, 11, 12)
    assert by_leaf["c6"].spawned_by == "c4" and by_leaf["c7"].spawned_by == "c2"
    assert {k: p.num_targets for k, p in by_leaf.items()} == {
        "c0": 4,
        "c6": 12,
        "c7": 18,
        "c9": 29,
        "c12": 55,
        "c15": 31,
        "c17": 16,
        "c19": 24,
    }
    selected, left_out = select_paths(paths, 5)
    assert [p.leaf_call_id for p in selected] == ["c19", "c17", "c15", "c12", "c7"]
    assert left_out == {"auxiliary": 1, "duplicate": 1, "over_cap": 1}
    selected, _ = select_paths(paths, 3)
    assert [p.leaf_call_id for p in selected] == ["c19", "c17", "c15"]


@pytest.mark.parametrize("k,capped,dedup", [(5, 144, 136), (100, 156, 148), (1, 24, 24)], ids=["K5", "uncapped", "K1"])
def test_token_counts_and_shared_prefix_counted_once(k, capped, dedup):
    result = process_execution(hand_built(), TrajectoryConfig(max_paths=k))
    c = result.counts
    assert (c.targets_naive, c.targets_capped, c.targets_dedup) == (156, capped, dedup)
    assert sum(int(s.unique_mask.sum()) for s in result.samples) == dedup
    for s in result.samples:
        assert (s.tokens[s.target_mask] >= POLICY_LO).all()  # only policy tokens are targets
        assert (s.versions[s.target_mask] >= 0).all() and (s.versions[~s.target_mask] == -1).all()
        assert (s.logprobs[~s.target_mask] == 0).all()


def test_masks_align_with_the_calls_that_sampled_them():
    records = hand_built()
    result = process_execution(records, TrajectoryConfig())
    final = next(s for s in result.samples if s.leaf_call_id == "c19")
    expect = np.zeros(final.tokens.size, bool)
    for i in (16, 18, 19):
        r = records[i]
        expect[r.input_ids.size : r.num_tokens] = True
        start = r.input_ids.size
        assert np.array_equal(final.logprobs[start : r.num_tokens], r.logprobs)
    assert np.array_equal(final.target_mask, expect)
    abandoned = next(s for s in result.samples if s.leaf_call_id == "c17")
    c16 = records[16]
    assert not abandoned.unique_mask[c16.input_ids.size : c16.num_tokens].any()  # trained on c19's path
    assert abandoned.unique_mask.sum() == 8


def test_version_split_inside_a_call_is_kept_per_token():
    result = process_execution(hand_built(), TrajectoryConfig())
    sub = next(s for s in result.samples if s.leaf_call_id == "c7")
    assert sub.versions[sub.target_mask][-6:].tolist() == [0, 0, 0, 1, 1, 1]


def test_file_order_does_not_matter():
    records = hand_built()
    shuffled = records[:]
    random.Random(0).shuffle(shuffled)
    assert _parents(build_call_tree(shuffled)) == PARENTS


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda rs: rs + [dataclasses.replace(rs[3], call_id="x")], "seq 3 used by calls"),
        (lambda rs: rs + [dataclasses.replace(rs[3], seq=99, started_at=2e9)], "call ids recorded more than once: c3"),
        (
            lambda rs: rs + [dataclasses.replace(rs[0], execution_id="other", seq=50, call_id="y", started_at=2e9)],
            "several executions",
        ),
        (lambda rs: [], "no records"),
        (
            lambda rs: rs[:4] + [dataclasses.replace(rs[4], seq=5), dataclasses.replace(rs[5], seq=4)] + rs[6:],
            "seq order contradicts start times: seq 5",
        ),
    ],
    ids=["duplicate-seq", "duplicate-call-id", "mixed-executions", "empty", "seq-out-of-order"],
)
def test_contradictory_records_are_a_clear_error(mutate, match):
    with pytest.raises(TrajectoryError, match=match):
        build_call_tree(mutate(hand_built()))


def test_missing_call_excludes_the_execution_or_becomes_context():
    records = [r for r in hand_built() if r.seq != 8]
    assert process_execution(records, TrajectoryConfig()).excluded == "missing_call"
    result = process_execution(records, TrajectoryConfig(allow_missing_calls=True))
    assert result.excluded is None and result.num_missing_calls == 1
    c8 = hand_built()[8]
    for s in result.samples:
        hit = s.tokens.size >= c8.num_tokens and np.array_equal(
            s.tokens[: c8.num_tokens], np.concatenate((c8.input_ids, c8.output_ids))
        )
        if hit:  # the lost call's output is in this context, but no longer a target
            assert not s.target_mask[c8.input_ids.size : c8.num_tokens].any()


def _write(path, records):
    with RecordWriter(path, fsync=False) as w:
        for r in records:
            w.append(r)


def test_bad_logprobs_in_file_become_a_counted_exclusion(tmp_path):
    """A record whose log-probs do not match its output is skipped by the reader; the gap then
    excludes the execution with a reason instead of training a misaligned sample."""
    import base64
    import json

    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    _write(good, hand_built("g"))
    _write(bad, hand_built("b"))
    lines = bad.read_text().splitlines()
    obj = json.loads(lines[11])
    obj["logprobs"] = base64.b64encode(base64.b64decode(obj["logprobs"])[:-4]).decode()
    lines[11] = json.dumps(obj)
    bad.write_text("\n".join(lines) + "\n")
    group = process_group(
        [(read_records(good)[0], Evaluation("finished", 1.0)), (read_records(bad)[0], Evaluation("finished", 0.0))],
        TrajectoryConfig(min_group_size=1, drop_uniform_groups=False),
    )
    assert group.excluded == {"missing_call": 1}
    assert {s.path.execution_id for s in group.samples} == {"g"}


def test_torn_file_loses_only_the_last_call(tmp_path):
    path = tmp_path / "ex.jsonl"
    records = hand_built()
    _write(path, records)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    back, stats = read_records(path)
    assert stats.num_torn == 1 and len(back) == len(records) - 1
    result = process_execution(back, TrajectoryConfig())
    assert result.excluded is None
    assert "c18" in [s.leaf_call_id for s in result.samples]  # c19 lost: c18 is now the final main leaf


def test_benchmark_execution_has_the_promised_shape():
    """tools/bench/trajectory.py's execution, tiny: 3 compactions, 6 sub-agents (2 nested, 1 compacting),
    4 duplicate re-sends, 1 auxiliary call, 1 rewound main branch."""
    from collections import Counter

    from _synthetic import make_claude_like

    records = make_claude_like(scale=0.02, num_rewinds=1).records
    paths = make_paths(build_call_tree(records))
    assert len(records) == 429
    assert Counter(p.path_class or p.excluded for p in paths) == {
        "main": 2,
        "main_summary": 3,
        "subagent": 8,
        "subagent_summary": 1,
        "duplicate": 4,
        "auxiliary": 1,
    }
    assert all(p.spawned_by is not None for p in paths if p.agent_id != "main")
