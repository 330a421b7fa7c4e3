"""Test helpers for gyre/train: an independent pure-torch forward under engine (HF/Qwen2) names, a
sampler that records behaviour log-probs like an engine, and a packer into PackedBatch.

The reference forward is written from the architecture contract (RMSNorm, SwiGLU, non-interleaved
rotate_half RoPE, GQA, no biases), not from Megatron, so it checks the converter independently.
TODO(train): switch to the builtin engine of gyre/engines when the engines branch lands.
"""

import torch
import torch.nn.functional as F

from gyre.models.config import ModelConfig
from gyre.trajectory.sample import PackedBatch


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, base):
    hd = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def ref_logits(w: dict, cfg: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    """Logits [L, V] of one sequence `ids` [L]."""
    L, hd, nh, nkv = ids.numel(), cfg.head_dim, cfg.num_attention_heads, cfg.num_query_groups
    pos = torch.arange(L)
    x = w["embed_tokens.weight"][ids]
    causal = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], cfg.norm_epsilon)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(L, nh, hd).transpose(0, 1)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(L, nkv, hd).transpose(0, 1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(L, nkv, hd).transpose(0, 1)
        q, k = _rope(q, pos, cfg.rotary_base), _rope(k, pos, cfg.rotary_base)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        att = (q @ k.transpose(1, 2)) / hd**0.5
        att = att.masked_fill(causal, float("-inf")).softmax(-1)
        o = (att @ v).transpose(0, 1).reshape(L, nh * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], cfg.norm_epsilon)
        mlp = F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
        x = x + mlp @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["norm.weight"], cfg.norm_epsilon)
    head = w["embed_tokens.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
    return x @ head.T


@torch.no_grad()
def ref_sample(w: dict, cfg: ModelConfig, prompt: list[int], n_new: int, gen: torch.Generator) -> tuple[list[int], list[float]]:
    """Sample `n_new` tokens at temperature 1; returns (output ids, behaviour log-probs)."""
    ids, lps = list(prompt), []
    for _ in range(n_new):
        logp = torch.log_softmax(ref_logits(w, cfg, torch.tensor(ids))[-1], -1)
        tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
        ids.append(tok)
        lps.append(float(logp[tok]))
    return ids[len(prompt) :], lps


def pack(seqs: list[dict]) -> PackedBatch:
    """Pack sequences {prompt, output, logprobs, advantage, weight=1, version=0, id} into one row."""
    cols = {k: [] for k in ("tokens", "pos", "mask", "blp", "w", "adv", "ver")}
    cu = [0]
    for s in seqs:
        n_p, n_o = len(s["prompt"]), len(s["output"])
        cols["tokens"] += list(s["prompt"]) + list(s["output"])
        cols["pos"] += list(range(n_p + n_o))
        cols["mask"] += [False] * n_p + [True] * n_o
        cols["blp"] += [0.0] * n_p + list(s["logprobs"])
        cols["w"] += [0.0] * n_p + [s.get("weight", 1.0)] * n_o
        cols["adv"] += [0.0] * n_p + [s["advantage"]] * n_o
        cols["ver"] += [-1] * n_p + [s.get("version", 0)] * n_o
        cu.append(cu[-1] + n_p + n_o)
    return PackedBatch(
        tokens=torch.tensor(cols["tokens"], dtype=torch.int64),
        position_ids=torch.tensor(cols["pos"], dtype=torch.int64),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        target_mask=torch.tensor(cols["mask"], dtype=torch.bool),
        behaviour_logprobs=torch.tensor(cols["blp"], dtype=torch.float32),
        loss_weights=torch.tensor(cols["w"], dtype=torch.float32),
        advantages=torch.tensor(cols["adv"], dtype=torch.float32),
        weight_versions=torch.tensor(cols["ver"], dtype=torch.int64),
        execution_ids=tuple(s.get("id", f"e{i}") for i, s in enumerate(seqs)),
    )


def random_batches(cfg: ModelConfig, n_batches: int, seqs_per_batch: int, seed: int, max_len: int = 24) -> list[PackedBatch]:
    """Synthetic micro-batches with plausible (negative) behaviour log-probs and mixed advantages."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        seqs = []
        for _ in range(seqs_per_batch):
            n_p = int(torch.randint(2, 8, (1,), generator=g))
            n_o = int(torch.randint(2, max_len - n_p, (1,), generator=g))
            seqs.append({
                "prompt": torch.randint(0, cfg.vocab_size, (n_p,), generator=g).tolist(),
                "output": torch.randint(0, cfg.vocab_size, (n_o,), generator=g).tolist(),
                "logprobs": (-torch.rand(n_o, generator=g) * 8 - 0.5).tolist(),
                "advantage": float(torch.randn(1, generator=g)),
            })
        out.append(pack(seqs))
    return out
