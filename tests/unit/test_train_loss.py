"""Policy loss and batch screening: pure cores, tables of cases."""

from dataclasses import replace

import pytest
import torch
from _train_ref import as_samples

from gyre.errors import ConfigError
from gyre.train.batch import BatchError, screen_batch
from gyre.train.config import TrainerConfig
from gyre.train.loss import finish_stats, merge_stats, policy_loss
from gyre.trajectory.pack import pack

CFG = TrainerConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, truncation_cap=3.0)


def _one_token(log_ratio: float, adv: float, cfg=CFG):
    lp = torch.tensor([0.0, -1.0 + log_ratio], requires_grad=True)
    mask = torch.tensor([False, True])
    loss, stats = policy_loss(
        lp, torch.tensor([0.0, -1.0]), torch.tensor([0.0, adv]), torch.tensor([0.0, 1.0]), mask, 1.0, cfg
    )
    loss.backward()
    return float(loss.detach()), float(lp.grad[1]), stats


@pytest.mark.parametrize(
    "log_ratio, adv, loss, grad, clipped, truncated",
    [
        pytest.param(0.0, 1.0, -1.0, -1.0, 0, 0, id="on-policy-positive: gradient raises the log-prob"),
        pytest.param(0.0, -1.0, 1.0, 1.0, 0, 0, id="on-policy-negative: gradient lowers the log-prob"),
        pytest.param(0.5, 1.0, -1.28, 0.0, 1, 0, id="ratio-above-clip-positive: no gradient"),
        pytest.param(-0.5, -1.0, 0.8, 0.0, 1, 0, id="ratio-below-clip-negative: no gradient"),
        pytest.param(2.0, -1.0, 3.0, 0.0, 0, 1, id="stale-ratio-7.4-negative: truncated at 3"),
        pytest.param(1.0, -1.0, 2.71828, 2.71828, 0, 0, id="ratio-e-negative: under the cap, full gradient"),
    ],
)
def test_token_loss_cases(log_ratio, adv, loss, grad, clipped, truncated):
    got_loss, got_grad, stats = _one_token(log_ratio, adv)
    assert got_loss == pytest.approx(loss, abs=1e-4)
    assert got_grad == pytest.approx(grad, abs=1e-4)
    assert (stats["clipped"], stats["truncated"]) == (clipped, truncated)


def test_truncation_off_keeps_the_unbounded_ratio():
    loss, _, stats = _one_token(2.0, -1.0, replace(CFG, truncation_cap=0.0))
    assert loss == pytest.approx(float(torch.exp(torch.tensor(2.0))), rel=1e-5) and stats["truncated"] == 0


def test_kl_term_is_zero_on_policy_and_positive_off_policy():
    cfg = replace(CFG, kl_coef=1.0, truncation_cap=0.0)
    assert _one_token(0.0, 0.0, cfg)[0] == pytest.approx(0.0)
    assert _one_token(0.1, 0.0, cfg)[0] > 0


@pytest.mark.parametrize("kl_coef", [0.0, 1.0], ids=["not-in-loss", "in-loss"])
def test_kl_mean_is_reported_whether_or_not_the_loss_uses_it(kl_coef):
    _, _, stats = _one_token(0.5, 1.0, replace(CFG, kl_coef=kl_coef))
    k3 = float(torch.exp(torch.tensor(-0.5)) + 0.5 - 1)
    assert finish_stats(stats)["kl_mean"] == pytest.approx(k3, rel=1e-5)


def test_stats_merge_to_the_same_means_however_split():
    g = torch.Generator().manual_seed(0)
    n = 12
    lp, blp = -torch.rand(n, generator=g), -torch.rand(n, generator=g)
    adv, w, m = torch.randn(n, generator=g), torch.ones(n), torch.ones(n, dtype=torch.bool)
    whole = finish_stats(policy_loss(lp, blp, adv, w, m, float(n), CFG)[1])
    parts = {}
    for sl in (slice(0, 5), slice(5, 12)):
        parts = merge_stats(parts, policy_loss(lp[sl], blp[sl], adv[sl], w[sl], m[sl], float(n), CFG)[1])
    split = finish_stats(parts)
    for k in whole:
        assert split[k] == pytest.approx(whole[k], rel=1e-6), k


def test_config_rejects_a_cap_that_is_not_above_one():
    with pytest.raises(ConfigError) as e:
        TrainerConfig(truncation_cap=0.5)
    assert e.value.key == "truncation_cap"


def _seq(**over):
    s = {"prompt": [1, 2, 3], "output": [4, 5], "logprobs": [-0.5, -1.0], "advantage": 1.0}
    return s | over


def _with(batch, **fields):
    return replace(batch, **fields)


def _shifted_logprobs(b):
    # A processor bug: log-probs one position early (the last prompt token carries one).
    return _with(b, behaviour_logprobs=torch.roll(b.behaviour_logprobs, -1))


@pytest.mark.parametrize(
    "make, reason",
    [
        pytest.param(lambda b: _shifted_logprobs(b), "logprobs_misaligned", id="shifted-logprobs"),
        pytest.param(
            lambda b: _with(
                b, target_mask=torch.zeros_like(b.target_mask), behaviour_logprobs=torch.zeros(b.num_tokens)
            ),
            "empty_targets",
            id="no-targets",
        ),
        pytest.param(
            lambda b: _with(b, loss_weights=torch.zeros(b.num_tokens)), "empty_targets", id="all-zero-weights"
        ),
        pytest.param(
            lambda b: _with(b, behaviour_logprobs=b.behaviour_logprobs.abs()),
            "logprobs_invalid",
            id="positive-logprobs",
        ),
        pytest.param(
            lambda b: _with(b, target_mask=torch.ones_like(b.target_mask)),
            "target_at_sequence_start",
            id="first-token-target",
        ),
        pytest.param(
            lambda b: _with(b, weight_versions=torch.full_like(b.weight_versions, -1)),
            "weight_version_missing",
            id="no-version",
        ),
    ],
)
def test_bad_sequences_are_dropped_with_a_reason(make, reason):
    bad = make(pack(as_samples([_seq(id="bad")])))
    good = pack(as_samples([_seq(id="good", output=[7, 8, 9], logprobs=[-1.0, -2.0, -0.1])]))
    both = pack(as_samples([_seq(id="x")]))  # structure template for concatenation below
    merged = replace(
        both,
        **{
            f: torch.cat([getattr(bad, f), getattr(good, f)])
            for f in (
                "tokens",
                "position_ids",
                "target_mask",
                "behaviour_logprobs",
                "loss_weights",
                "advantages",
                "weight_versions",
            )
        },
        cu_seqlens=torch.tensor([0, bad.num_tokens, bad.num_tokens + good.num_tokens], dtype=torch.int32),
        execution_ids=("bad", "good"),
    )
    kept, counts, rejected = screen_batch(merged, vocab_size=16)
    assert rejected == [("bad", reason)] and counts[reason] == 1
    assert kept.execution_ids == ("good",) and torch.equal(kept.tokens, good.tokens)
    assert kept.cu_seqlens.tolist() == [0, good.num_tokens]
    with pytest.raises(BatchError, match=reason):
        screen_batch(bad, vocab_size=16)


@pytest.mark.parametrize(
    "make, match",
    [
        pytest.param(lambda b: _with(b, advantages=b.advantages[:-1]), "advantages has shape", id="short-array"),
        pytest.param(
            lambda b: _with(b, cu_seqlens=torch.tensor([0, 3], dtype=torch.int32)), "cu_seqlens", id="bad-boundaries"
        ),
        pytest.param(lambda b: _with(b, tokens=b.tokens + 100), "token ids", id="out-of-vocab"),
        pytest.param(lambda b: _with(b, execution_ids=()), "execution_ids", id="ids-missing"),
        pytest.param(
            lambda b: _with(b, advantages=b.advantages.long()), "advantages has dtype", id="integer-advantages"
        ),
        pytest.param(lambda b: _with(b, target_mask=b.target_mask.float()), "target_mask has dtype", id="float-mask"),
    ],
)
def test_structural_faults_reject_the_whole_batch(make, match):
    with pytest.raises(BatchError, match=match):
        screen_batch(make(pack(as_samples([_seq()]))), vocab_size=16)


def test_trainer_group_composes_and_names_bad_keys():
    import hydra

    from gyre.common import CONF_DIR
    from gyre.config import register_configs, validate

    register_configs()
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        good = validate(hydra.compose(config_name="config"))
        slurm = validate(hydra.compose(config_name="config", overrides=["cluster=slurm"]))
        bad = hydra.compose(config_name="config", overrides=["trainer.num_grad_slots=0"])
        hang = hydra.compose(config_name="config", overrides=["trainer.rank_hang_timeout_s=-1"])
    assert isinstance(good.trainer, TrainerConfig) and good.trainer.truncation_cap == 3.0
    # hung ranks and satellites are found on Slurm by default; a local claim lasts while its cell lives
    assert (slurm.trainer.claim_timeout_s, good.trainer.claim_timeout_s) == (600.0, 0.0)
    assert 0 < slurm.trainer.rank_hang_timeout_s <= 120 and slurm.trainer.collective_timeout_s > 0
    for cfg, key in ((bad, "trainer.num_grad_slots"), (hang, "trainer.rank_hang_timeout_s")):
        with pytest.raises(ConfigError) as e:
            validate(cfg)
        assert e.value.key == key


def test_learning_rate_warms_up_linearly_then_stays_constant():
    cfg = TrainerConfig(lr=1e-3, lr_warmup_steps=4)
    assert [cfg.lr_at(s) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert TrainerConfig(lr=1e-3).lr_at(0) == 1e-3
    with pytest.raises(ConfigError, match="lr_warmup_steps"):
        TrainerConfig(lr_warmup_steps=-1)
