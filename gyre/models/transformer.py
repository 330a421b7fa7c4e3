"""The engine-side decoder: named weights (HF/Qwen2 names), deterministic init, and a functional forward.

Weights are a flat dict `name -> tensor` with the names agreed with the trainer's converter:
`embed_tokens.weight [V,H]`, `layers.{i}.input_layernorm.weight [H]`,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.post_attention_layernorm.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight` (absent when tied),
and with `qk_norm` `layers.{i}.self_attn.{q,k}_norm.weight [head_dim]` (Qwen3). No biases. RMSNorm,
SwiGLU, non-interleaved ("rotate_half") RoPE, grouped-query attention.

`forward_tokens` is the one forward both the engine (with a KV cache, many sequences per step) and
the reference `sequence_logprobs` (one sequence, no cache) run, so their results agree.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gyre.models.config import ModelConfig

# Called once per layer with (layer index, q [T,nH,hd], k [T,nKV,hd], v [T,nKV,hd], positions [T]);
# returns attention output [T, nH*hd]. The engine's version reads and extends its KV caches.
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in a fixed order (the order init draws them in)."""
    h, hd, f = cfg.hidden_size, cfg.head_dim, cfg.ffn_hidden_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_query_groups * hd
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    shapes["norm.weight"] = (h,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def init_weights(cfg: ModelConfig, seed: int, std: float = 0.1) -> dict[str, torch.Tensor]:
    """Random fp32 weights, the same for the same (cfg, seed) on every machine; norms start at 1.

    `std` is larger than a training init so the tiny random model has peaked, non-uniform outputs.
    """
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.randn(shape, generator=g) * std
    return weights


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Raise ValueError naming missing, unexpected or mis-shaped parameters."""
    shapes = param_shapes(cfg)
    missing = sorted(set(shapes) - set(weights))
    extra = sorted(set(weights) - set(shapes))
    wrong = [
        f"{n}: {tuple(weights[n].shape)} != {s}"
        for n, s in shapes.items()
        if n in weights and tuple(weights[n].shape) != s
    ]
    if missing or extra or wrong:
        raise ValueError(
            f"weights do not match the model config: missing={missing[:5]} unexpected={extra[:5]} "
            f"wrong_shapes={wrong[:5]}"
        )


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, hd] for non-interleaved halves (HF `rotate_half`); computed once per forward."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], -1)[:, None, :]
    return angles.cos(), angles.sin()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, hd] by the positions `cos`/`sin` were made for."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


ATTENTION_MASK_BYTES = 16 << 20
"""Upper bound of one attention call's mask: queries are taken in blocks small enough that the
mask (and the fused kernel's working set) stays bounded whatever the context length."""


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int) -> torch.Tensor:
    """Causal attention of T new queries over `num_cached + T` keys for one sequence.

    Runs PyTorch's fused (flash) CPU/GPU kernel: batched 4-D inputs and native GQA, so scores are
    never materialised; the causal mask of cached + new keys is bottom-right aligned, which
    `is_causal` (top-left) cannot express, so query blocks carry a small additive mask instead.

    Args: q [T,nH,hd]; k, v [S,nKV,hd] with S = num_cached + T (cached keys first).
    Returns: [T, nH*hd].
    """
    t, nh, hd = q.shape
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, heads, len, hd]
    if t == 1 or num_cached == 0:  # one query sees every key; or a square causal block
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=t > 1, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(t, nh * hd)
    block = max(16, ATTENTION_MASK_BYTES // (4 * k.shape[0]))
    outs = []
    for a in range(0, t, block):
        b = min(t, a + block)
        visible = num_cached + b  # keys the last query of the block sees
        allowed = (
            torch.arange(visible, device=q.device)[None, :]
            <= (num_cached + torch.arange(a, b, device=q.device))[:, None]
        )
        mask = torch.zeros(b - a, visible, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        outs.append(
            F.scaled_dot_product_attention(
                qh[:, :, a:b], kh[:, :, :visible], vh[:, :, :visible], attn_mask=mask, enable_gqa=True
            )
        )
    return torch.cat(outs, dim=2)[0].transpose(0, 1).reshape(t, nh * hd)


def forward_tokens(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], ids: torch.Tensor, positions: torch.Tensor, attend_fn: AttendFn
) -> torch.Tensor:
    """Hidden states after the final norm for a flat batch of tokens [T] -> [T, H].

    Token-wise work (projections, MLP) runs on all T at once; `attend_fn` does the per-sequence part.
    """
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim
    x = weights["embed_tokens.weight"][ids]
    cos, sin = (
        t.to(x.dtype) for t in rope_tables(positions, hd, cfg.rotary_base)
    )  # as transformers: bf16 weights, bf16 q/k
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = rms_norm(x, weights[p + "input_layernorm.weight"], cfg.norm_epsilon)
        q = (h @ weights[p + "self_attn.q_proj.weight"].T).view(-1, nh, hd)
        k = (h @ weights[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd)
        v = (h @ weights[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        if cfg.qk_norm:
            q = rms_norm(q, weights[p + "self_attn.q_norm.weight"], cfg.norm_epsilon)
            k = rms_norm(k, weights[p + "self_attn.k_norm.weight"], cfg.norm_epsilon)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        x = x + attend_fn(i, q, k, v) @ weights[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, weights[p + "post_attention_layernorm.weight"], cfg.norm_epsilon)
        gate = F.silu(h @ weights[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (h @ weights[p + "mlp.up_proj.weight"].T)) @ weights[p + "mlp.down_proj.weight"].T
    return rms_norm(x, weights["norm.weight"], cfg.norm_epsilon)


def logits_of(cfg: ModelConfig, weights: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    head = weights["embed_tokens.weight"] if cfg.tie_embeddings else weights["lm_head.weight"]
    return hidden @ head.T


def sequence_logprobs(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], token_ids: list[int] | torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Reference log-probs of tokens[1:] given their prefixes, from one full-sequence forward.

    Returns a [len-1] tensor: entry j is log p(tokens[j+1] | tokens[:j+1]) under softmax(logits /
    temperature) (temperature 0 means 1: greedy decoding has no distribution of its own).
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    positions = torch.arange(len(ids))
    hidden = forward_tokens(cfg, weights, ids, positions, lambda _i, q, k, v: attend(q, k, v, 0))
    logits = logits_of(cfg, weights, hidden[:-1])
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits.float(), -1)
    return logp.gather(1, ids[1:, None]).squeeze(1)
