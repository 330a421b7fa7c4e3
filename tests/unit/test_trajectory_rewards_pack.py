"""Reward rules, group advantages, loss weights and packing into the trainer's PackedBatch."""

import numpy as np
import pytest
import torch
from _synthetic import SyntheticExecution, Thread

from gyre.errors import ConfigError
from gyre.trajectory.config import TrajectoryConfig
from gyre.trajectory.pack import make_micro_batches, pack
from gyre.trajectory.process import process_group
from gyre.trajectory.rewards import Evaluation, group_advantages, reward_of, settle_budget, unscored_reason
from gyre.trajectory.tree import TrajectoryError


def small(execution_id, n_turns=3, seed=0):
    ex = SyntheticExecution(execution_id, seed=seed)
    main = Thread(ex, "main", None, ex.context(20))
    for _ in range(n_turns):
        main.turn(5, 7)
    sub = Thread(ex, "s", "main", ex.context(15))
    sub.turn(4, 6)
    return ex.records


@pytest.mark.parametrize(
    "evaluation,expect",
    [
        (Evaluation("finished", 0.75), (0.75, None)),
        (Evaluation("timed_out", 0.4), (0.4, None)),
        (Evaluation("timed_out", 0.0), (None, "budget_exhausted")),
        (Evaluation("evaluator_error", None, "pytest crashed"), (None, "evaluator_error")),
        (Evaluation("evaluator_error", 0.0), (None, "evaluator_error")),
        (Evaluation("budget_exhausted"), (None, "budget_exhausted")),
        (Evaluation("finished", None), (None, "no_score")),
    ],
    ids=[
        "finished",
        "timed-out-partial",
        "timed-out-zero",
        "evaluator-crash",
        "evaluator-crash-with-zero",
        "budget",
        "finished-unscored",
    ],
)
def test_reward_rules(evaluation, expect):
    assert reward_of(evaluation) == expect


@pytest.mark.parametrize(
    "evaluation,expect",
    [
        (Evaluation("timed_out", 0.4, "0.4"), ("timed_out", 0.4)),
        (Evaluation("timed_out", 0.0, "no answer.txt"), ("budget_exhausted", None)),
        (Evaluation("timed_out", -1.0), ("budget_exhausted", None)),
        (Evaluation("timed_out", None, "verifier wrote no reward"), ("budget_exhausted", None)),
        (Evaluation("finished", 0.0), ("finished", 0.0)),
        (Evaluation("evaluator_error", None), ("evaluator_error", None)),
    ],
    ids=["partial-credit", "zero", "negative", "no-score", "finished-zero", "evaluator-error"],
)
def test_a_timed_out_run_keeps_only_partial_credit(evaluation, expect):
    """The seed: a run stopped at its budget is trained with the credit its workspace earns; one
    with none has no valid reward and is discarded (a finished run's 0 is a real 0)."""
    settled = settle_budget(evaluation)
    assert (settled.outcome, settled.score) == expect
    if expect[0] != evaluation.outcome:
        assert evaluation.detail in settled.detail and "time budget" in settled.detail


@pytest.mark.parametrize(
    "exit_code,calls,timed_out,expect",
    [
        (3, False, False, "harness_failed"),
        (-9, False, False, "harness_failed"),
        (0, False, False, "no_model_calls"),
        (-15, False, True, "budget_exhausted"),
        (3, True, False, None),
        (-15, True, True, None),
    ],
    ids=["crashed", "killed", "no-calls", "timed-out-before-a-call", "called", "timed-out-after-calls"],
)
def test_a_harness_without_model_calls_is_unscored(exit_code, calls, timed_out, expect):
    assert unscored_reason(exit_code, calls, timed_out) == expect


def test_evaluation_rejects_unknown_outcome_and_bad_score():
    with pytest.raises(ValueError, match="not one of finished"):
        Evaluation("crashed")
    with pytest.raises(ValueError, match="finite"):
        Evaluation("finished", float("nan"))
    assert Evaluation("finished", 1.5).score == 1.5  # a Harbor verifier's reward outside [0, 1] is kept


def test_group_advantages_grpo():
    adv, reason = group_advantages({"a": 1.0, "b": 0.0, "c": 0.5, "d": 0.5}, TrajectoryConfig())
    std = np.std([1.0, 0.0, 0.5, 0.5])
    assert reason is None
    assert adv == pytest.approx({"a": 0.5 / std, "b": -0.5 / std, "c": 0.0, "d": 0.0}, rel=1e-5)
    adv, _ = group_advantages({"a": 1.0, "b": 0.0}, TrajectoryConfig(normalize_std=False))
    assert adv == {"a": 0.5, "b": -0.5}
    assert group_advantages({"a": 1.0}, TrajectoryConfig()) == ({}, "group_too_small")
    assert group_advantages({"a": 0.3, "b": 0.3}, TrajectoryConfig()) == ({}, "uniform_group")


def test_group_counts_every_exclusion_and_normalises_after_them():
    group = process_group(
        [
            (small("ok1"), Evaluation("finished", 1.0)),
            (small("ok2", seed=1), Evaluation("timed_out", 0.2)),
            (small("crash", seed=2), Evaluation("evaluator_error", detail="oom")),
            (small("slow", seed=3), Evaluation("budget_exhausted")),
            ([], Evaluation("finished", 0.5)),
        ],
        TrajectoryConfig(),
    )
    assert group.excluded == {"evaluator_error": 1, "budget_exhausted": 1, "bad_records": 1}
    assert group.excluded_executions == [
        ("crash", "evaluator_error"),
        ("slow", "budget_exhausted"),
        (None, "bad_records"),
    ]
    assert group.rewards == {"ok1": 1.0, "ok2": 0.2}
    assert group.advantages == pytest.approx({"ok1": 1.0, "ok2": -1.0}, rel=1e-4)
    assert {s.path.execution_id for s in group.samples} == {"ok1", "ok2"}


def test_loss_weights_per_execution_under_each_averaging():
    short, long_ = small("short", n_turns=1), small("long", n_turns=8, seed=1)  # 5+4 and 40+4 targets, 2 paths
    expected = {
        "path": {"short": 4.5, "long": 22.0},
        "execution": {"short": 1.0, "long": 1.0},
        "token": {"short": 9.0, "long": 44.0},
    }
    for mode, expect in expected.items():
        group = process_group(
            [(short, Evaluation("finished", 1.0)), (long_, Evaluation("finished", 0.0))],
            TrajectoryConfig(averaging=mode),
        )
        totals = {}
        for s in group.samples:
            totals[s.path.execution_id] = totals.get(s.path.execution_id, 0.0) + float(s.loss_weights.sum())
        assert totals == pytest.approx(expect)


def test_path_averaging_cancels_a_call_every_execution_makes_alike_and_execution_averaging_does_not():
    """A short failed and a long successful execution open with the same call: under `execution`
    averaging its tokens weigh more in the short one, so the step pushes that shared call down (a
    length bias). Under `path` its weighted advantages sum to 0."""
    failed, solved = small("failed", n_turns=1), small("solved", n_turns=4)  # same seed: same first call
    net = {}
    for mode in ("path", "execution"):
        group = process_group(
            [(failed, Evaluation("finished", 0.0)), (solved, Evaluation("finished", 1.0))],
            TrajectoryConfig(averaging=mode),
        )
        first_call = []
        for s in group.samples:
            if s.path.path_class == "main":
                on = np.flatnonzero(s.path.target_mask)[:5]  # the first turn's 5 output tokens
                first_call.append((s.path.tokens[on].tolist(), s.advantage * float(s.loss_weights[on].sum())))
        assert len(first_call) == 2 and first_call[0][0] == first_call[1][0]
        net[mode] = sum(w for _, w in first_call)
    assert net["path"] == pytest.approx(0.0, abs=1e-6)
    assert net["execution"] < -0.05


def test_pack_follows_the_packed_batch_alignment():
    group = process_group(
        [(small("a"), Evaluation("finished", 1.0)), (small("b", seed=1), Evaluation("finished", 0.0))],
        TrajectoryConfig(averaging="execution"),
    )
    batch = pack(group.samples)
    lengths = [s.path.tokens.size for s in group.samples]
    assert batch.cu_seqlens.tolist() == np.concatenate(([0], np.cumsum(lengths))).tolist()
    assert batch.cu_seqlens.dtype == torch.int32 and batch.tokens.dtype == torch.int64
    for k, s in enumerate(group.samples):
        lo, hi = int(batch.cu_seqlens[k]), int(batch.cu_seqlens[k + 1])
        assert batch.position_ids[lo:hi].tolist() == list(range(hi - lo))
        assert not batch.target_mask[lo]  # the first token of a sequence is never a target
        assert torch.equal(batch.tokens[lo:hi], torch.from_numpy(s.path.tokens.astype(np.int64)))
        assert torch.equal(batch.behaviour_logprobs[lo:hi], torch.from_numpy(s.path.logprobs))
        mask = batch.target_mask[lo:hi]
        assert torch.all(batch.advantages[lo:hi][mask] == np.float32(s.advantage))
        assert torch.all(batch.advantages[lo:hi][~mask] == 0) and torch.all(batch.weight_versions[lo:hi][~mask] == -1)
    assert batch.execution_ids == tuple(s.path.execution_id for s in group.samples)
    assert batch.num_targets == sum(int(s.path.target_mask.sum()) for s in group.samples)
    assert float(batch.loss_weights.sum()) == pytest.approx(2.0)
    assert torch.all(batch.loss_weights[~batch.target_mask] == 0)


def test_micro_batches_respect_the_token_limit():
    group = process_group(
        [
            (small("a", n_turns=4), Evaluation("finished", 1.0)),
            (small("b", n_turns=2, seed=1), Evaluation("finished", 0.0)),
        ],
        TrajectoryConfig(),
    )
    longest = max(s.path.tokens.size for s in group.samples)
    batches = make_micro_batches(group.samples, longest)
    assert all(b.num_tokens <= longest for b in batches)
    assert sum(len(b.execution_ids) for b in batches) == len(group.samples)
    total = sum(float(s.loss_weights.sum()) for s in group.samples)
    assert sum(float(b.loss_weights.sum()) for b in batches) == pytest.approx(total)
    with pytest.raises(TrajectoryError, match="more than max_tokens=10"):
        make_micro_batches(group.samples, 10)
    with pytest.raises(TrajectoryError, match="nothing to pack"):
        pack([])


def test_micro_batches_are_as_few_as_fit_and_even_and_one_per_replica_at_least():
    """Four paths of one size under a limit of three: first fit in order makes rows of 3 and 1,
    which leaves one training cell with three quarters of the group; balanced rows are 2 and 2.
    With four data-parallel replicas per cell, a row each."""

    def main_only(execution_id):
        ex = SyntheticExecution(execution_id)
        Thread(ex, "main", None, ex.context(20)).turn(5, 7)
        return ex.records

    group = process_group(
        [(main_only(x), Evaluation("finished", float(i % 2))) for i, x in enumerate("abcd")], TrajectoryConfig()
    )
    sizes = sorted(s.path.tokens.size for s in group.samples)
    assert len(sizes) == 4 and sizes[0] == sizes[-1]
    batches = make_micro_batches(group.samples, 3 * sizes[0])
    assert [b.num_tokens for b in batches] == [2 * sizes[0]] * 2
    assert [b.execution_ids for b in batches] == [("a", "c"), ("b", "d")]  # in order within a row
    assert sum(float(b.loss_weights.sum()) for b in batches) == pytest.approx(4 * 5.0)  # 4 one-path executions
    # A cell of four data-parallel replicas: a row each, though two rows would fit.
    batches = make_micro_batches(group.samples, 3 * sizes[0], min_rows=4)
    assert [b.execution_ids for b in batches] == [("a",), ("b",), ("c",), ("d",)]
    assert len(make_micro_batches(group.samples, 3 * sizes[0], min_rows=8)) == 4  # a row needs a path


@pytest.mark.parametrize(
    "kw,key",
    [
        (dict(max_paths=0), "max_paths"),
        (dict(averaging="sequence"), "averaging"),
        (dict(std_eps=0.0), "std_eps"),
        (dict(min_group_size=0), "min_group_size"),
    ],
    ids=["K0", "averaging", "eps", "group-size"],
)
def test_config_errors_name_the_key(kw, key):
    with pytest.raises(ConfigError) as e:
        TrajectoryConfig(**kw)
    assert e.value.key == key
