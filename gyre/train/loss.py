"""The policy loss (pure): token-level PPO-clip on behaviour log-probs with a truncated importance weight.

For each target token t with advantage A_t and ratio r_t = pi_theta(t) / pi_behaviour(t) (the
engine's recorded log-prob, possibly some weight versions old):

    surrogate_t = min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
    loss_t      = -max(surrogate_t, c A_t)  if A_t < 0 and c > 0   (dual clip: r_t counts at most c)
                  -surrogate_t              otherwise
    loss        = sum_t w_t (loss_t + kl_coef k3_t - entropy_coef H_t) / normaliser

w_t is the processor's per-token loss weight (0 for context and deduplicated copies). The
normaliser is the sum of w over the whole optimizer step, so micro-steps add up to one token-level
mean no matter how the step is split or who computes which part. Metrics come back as sums, maxima
and minima so that micro-steps merge exactly (`merge_stats`) and are averaged once (`finish_stats`).
"""

import torch

from gyre.train.config import TrainerConfig


def policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_weights: torch.Tensor,
    target_mask: torch.Tensor,
    normaliser: float,
    cfg: TrainerConfig,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one micro-batch (per-token [T] tensors aligned with the packed tokens) and its stats.

    Args:
        logprobs: trainer log-probs of each token (differentiable); non-targets are ignored.
        normaliser: total loss weight of the optimizer step this micro-batch belongs to (> 0).
        entropy: per-token policy entropy, needed only when cfg.entropy_coef > 0.

    Returns:
        (scalar loss to backpropagate, additive stats of this micro-batch)
    """
    m = target_mask
    lp, blp, adv, w = logprobs[m], behaviour_logprobs[m], advantages[m], loss_weights[m]
    log_ratio = lp - blp
    ratio = torch.exp(log_ratio)
    token_loss, clipped, truncated = _clip_loss(ratio, adv, cfg)
    kl = torch.exp(-log_ratio) + log_ratio - 1  # k3 estimator of KL(pi_theta || pi_behaviour): unbiased, >= 0
    if cfg.kl_coef > 0:
        token_loss = token_loss + cfg.kl_coef * kl
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        token_loss = token_loss - cfg.entropy_coef * entropy[m]
    loss = (token_loss * w).sum() / normaliser
    with torch.no_grad():
        gap = log_ratio.abs()
        trained = w > 0
        stats = {
            "loss_sum": float((token_loss * w).sum()),
            "weight_sum": float(w.sum()),
            "num_targets": int(m.sum()),
            "num_trained": int(trained.sum()),
            "clipped": int((clipped & trained).sum()),
            "truncated": int((truncated & trained).sum()),
            "ratio_sum": float(ratio.sum()),
            "ratio_max": float(ratio.max()) if ratio.numel() else 0.0,
            "ratio_min": float(ratio.min()) if ratio.numel() else 0.0,
            "logprob_gap_sum": float(gap.sum()),
            "logprob_gap_max": float(gap.max()) if gap.numel() else 0.0,
            "kl_sum": float(kl.detach().sum()),
        }
        if entropy is not None:
            stats["entropy_sum"] = float(entropy[m].sum())
    return loss, stats


def _clip_loss(
    ratio: torch.Tensor, adv: torch.Tensor, cfg: TrainerConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss with the dual clip (see the module docstring).

    Returns:
        (loss_t, tokens whose clipped surrogate was the smaller, tokens the dual clip truncated)
    """
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    token_loss = -surrogate
    truncated = torch.zeros_like(adv, dtype=torch.bool)
    if cfg.truncation_cap > 0:
        floor = cfg.truncation_cap * adv
        truncated = (adv < 0) & (surrogate < floor)
        token_loss = torch.where(truncated, -floor, token_loss)
    return token_loss, clipped < unclipped, truncated


def merge_stats(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Combine two micro-batches' stats: `_max`/`_min` keys by max/min, the rest by addition."""
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v
        elif k.endswith("_max"):
            out[k] = max(out[k], v)
        elif k.endswith("_min"):
            out[k] = min(out[k], v)
        else:
            out[k] = out[k] + v
    return out


def finish_stats(s: dict[str, float]) -> dict[str, float]:
    """Turn merged sums into the metrics people read (means and fractions over target tokens)."""
    n = max(s.get("num_targets", 0), 1)
    n_trained = max(s.get("num_trained", 0), 1)
    out = {k: v for k, v in s.items() if not k.endswith("_sum") and k not in ("clipped", "truncated")}
    out["loss"] = s.get("loss_sum", 0.0) / max(s.get("weight_sum", 0.0), 1e-12)
    out["clip_fraction"] = s.get("clipped", 0) / n_trained
    out["truncated_fraction"] = s.get("truncated", 0) / n_trained
    out["ratio_mean"] = s.get("ratio_sum", 0.0) / n
    out["logprob_gap_mean"] = s.get("logprob_gap_sum", 0.0) / n
    out["kl_mean"] = s.get("kl_sum", 0.0) / n
    if "entropy_sum" in s:
        out["entropy_mean"] = s["entropy_sum"] / n
    return out
