"""Weight conversion between the trainer's megatron-core GPTModel and the engines' HF/Qwen2 names.

Megatron fuses q, k, v per query group in `linear_qkv` ([q_g; k_g; v_g] for each KV group g) and the
SwiGLU gate and up projections in `linear_fc1` ([gate; up]). Engines use separate
`self_attn.{q,k,v,o}_proj` and `mlp.{gate,up,down}_proj` weights (no biases); Qwen3's per-head
`self_attn.{q,k}_norm` are Megatron's `self_attention.{q,k}_layernorm`. Both directions are
pure functions on full (un-sharded) state dicts; gyre/models/checkpoint.py writes the result to disk
for engines, gyre/train/publish.py pushes it to them over Mooncake.

megatron-core names a layer's norms after its layer spec. The local spec (CPU) has modules
`input_layernorm` and `pre_mlp_layernorm`; the TransformerEngine spec (CUDA with TE,
megatron/core/models/gpt/gpt_layer_specs.py `get_gpt_layer_with_transformer_engine_spec`) makes
both IdentityOp and fuses each norm into the linear layer after it (TELayerNormColumnParallelLinear:
`linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`). Both are read here, and
`engine_to_megatron(..., te=True)` writes the TE names.
"""

import torch

from gyre.errors import GyreError
from gyre.models.config import ModelConfig

_QK_NORMS = (
    ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
    ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
)  # (megatron, engine)


_TE_NORMS = (
    ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
)  # (local spec, TE spec), under decoder.layers.<i>.


def local_spec_name(name: str) -> str:
    """A megatron-core parameter name under the local layer spec (TE spec names mapped; others kept)."""
    for local, te in _TE_NORMS:
        if name.endswith("." + te):
            return name.removesuffix(te) + local
    return name


def te_spec_name(name: str) -> str:
    """A local-spec parameter name under the TransformerEngine layer spec (the inverse of `local_spec_name`)."""
    for local, te in _TE_NORMS:
        if name.startswith("decoder.layers.") and name.endswith("." + local):
            return name.removesuffix(local) + te
    return name


class ConversionError(GyreError):
    """A state dict does not match the architecture it is converted for."""


def _qkv_split(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hd, groups = cfg.head_dim, cfg.num_query_groups
    q_per_group = cfg.num_attention_heads // groups
    grouped = qkv.view(groups, (q_per_group + 2) * hd, cfg.hidden_size)
    q, k, v = torch.split(grouped, [q_per_group * hd, hd, hd], dim=1)
    return (q.reshape(-1, cfg.hidden_size), k.reshape(-1, cfg.hidden_size), v.reshape(-1, cfg.hidden_size))


def _qkv_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    hd, groups, h = cfg.head_dim, cfg.num_query_groups, cfg.hidden_size
    q_per_group = cfg.num_attention_heads // groups
    fused = torch.cat([q.view(groups, q_per_group * hd, h), k.view(groups, hd, h), v.view(groups, hd, h)], dim=1)
    return fused.reshape(-1, h)


def megatron_to_engine(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map a full GPTModel state dict, of either layer spec, to engine names (copies; `_extra_state`
    entries are ignored).

    Raises:
        ConversionError: a tensor is missing or has the wrong shape for `cfg`.
    """
    get = _getter({local_spec_name(n): t for n, t in state.items()}, "megatron")
    out = {"embed_tokens.weight": get("embedding.word_embeddings.weight", (cfg.vocab_size, cfg.hidden_size))}
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim
    for i in range(cfg.num_layers):
        src, dst = f"decoder.layers.{i}.", f"layers.{i}."
        q, k, v = _qkv_split(get(src + "self_attention.linear_qkv.weight", (qkv_rows, h)), cfg)
        gate, up = torch.split(get(src + "mlp.linear_fc1.weight", (2 * f, h)), [f, f], dim=0)
        out.update(
            {
                dst + "input_layernorm.weight": get(src + "input_layernorm.weight", (h,)),
                dst + "self_attn.q_proj.weight": q,
                dst + "self_attn.k_proj.weight": k,
                dst + "self_attn.v_proj.weight": v,
                dst + "self_attn.o_proj.weight": get(
                    src + "self_attention.linear_proj.weight", (h, cfg.num_attention_heads * cfg.head_dim)
                ),
                dst + "post_attention_layernorm.weight": get(src + "pre_mlp_layernorm.weight", (h,)),
                dst + "mlp.gate_proj.weight": gate,
                dst + "mlp.up_proj.weight": up,
                dst + "mlp.down_proj.weight": get(src + "mlp.linear_fc2.weight", (h, f)),
            }
        )
        for a, b in _QK_NORMS if cfg.qk_norm else ():
            out[dst + b] = get(src + a, (cfg.head_dim,))
    out["norm.weight"] = get("decoder.final_layernorm.weight", (h,))
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = get("output_layer.weight", (cfg.vocab_size, h))
    return {name: t.detach().clone().contiguous() for name, t in out.items()}


def engine_to_megatron(state: dict[str, torch.Tensor], cfg: ModelConfig, te: bool = False) -> dict[str, torch.Tensor]:
    """Map engine-named weights to a full GPTModel state dict (the inverse of `megatron_to_engine`),
    under the local layer spec's names or, with `te`, the TransformerEngine spec's.

    Raises:
        ConversionError: a tensor is missing or has the wrong shape for `cfg`.
    """
    get = _getter(state, "engine")
    h, f, hd = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    out = {"embedding.word_embeddings.weight": get("embed_tokens.weight", (cfg.vocab_size, h))}
    for i in range(cfg.num_layers):
        src, dst = f"layers.{i}.", f"decoder.layers.{i}."
        q = get(src + "self_attn.q_proj.weight", (cfg.num_attention_heads * hd, h))
        k = get(src + "self_attn.k_proj.weight", (cfg.num_query_groups * hd, h))
        v = get(src + "self_attn.v_proj.weight", (cfg.num_query_groups * hd, h))
        out.update(
            {
                dst + "input_layernorm.weight": get(src + "input_layernorm.weight", (h,)),
                dst + "self_attention.linear_qkv.weight": _qkv_fuse(q, k, v, cfg),
                dst + "self_attention.linear_proj.weight": get(
                    src + "self_attn.o_proj.weight", (h, cfg.num_attention_heads * hd)
                ),
                dst + "pre_mlp_layernorm.weight": get(src + "post_attention_layernorm.weight", (h,)),
                dst + "mlp.linear_fc1.weight": torch.cat(
                    [get(src + "mlp.gate_proj.weight", (f, h)), get(src + "mlp.up_proj.weight", (f, h))]
                ),
                dst + "mlp.linear_fc2.weight": get(src + "mlp.down_proj.weight", (h, f)),
            }
        )
        for a, b in _QK_NORMS if cfg.qk_norm else ():
            out[dst + a] = get(src + b, (hd,))
    out["decoder.final_layernorm.weight"] = get("norm.weight", (h,))
    if not cfg.tie_embeddings:
        out["output_layer.weight"] = get("lm_head.weight", (cfg.vocab_size, h))
    rename = te_spec_name if te else str
    return {rename(name): t.detach().clone().contiguous() for name, t in out.items()}


def _getter(state: dict[str, torch.Tensor], side: str):
    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in state:
            raise ConversionError(f"{side} state dict lacks {name!r}")
        t = state[name]
        if tuple(t.shape) != shape:
            raise ConversionError(f"{side} tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t

    return get
