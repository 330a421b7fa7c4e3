"""Hugging Face checkpoint directories: config.json <-> ModelConfig, HF tensor names <-> engine names.

Supported: `qwen3` (dense; q/k norm, explicit head_dim) and `llama` (the same decoder without q/k
norm; Gyre's own model family is exported as it). Everything that would change the computation
and that Gyre does not implement (biases, sliding windows, RoPE scaling, MoE, another activation)
is refused with a ConfigError naming the config.json field, never loaded as a silently wrong
model. Engine names are HF names without the `model.` prefix (`lm_head.weight` stays).
"""

import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gyre.common import jsonio
from gyre.common.files import atomic_path, write_atomic
from gyre.errors import ConfigError
from gyre.models.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("qwen3", "llama")
MOE_REFUSED = (
    "mixture-of-experts models are not supported: no expert weight conversion, and megatron-core's "
    "MoE layer needs CUDA, so none could be tested on CPU (tools/probe/moe_cpu.py)"
)
_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".safetensors.index.json", ".bin.index.json")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_config_fields(raw: dict, where: str = "config.json") -> dict:
    """ModelConfig fields from a parsed config.json (pure).

    Raises:
        ConfigError: key `path`, message naming the config.json field Gyre cannot honour.
    """

    def refuse(field: str, why: str):
        raise ConfigError("path", f"{where}: field {field!r} {why}")

    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        moe = f" ({MOE_REFUSED})" if "moe" in str(model_type) else ""
        refuse("model_type", f"is {model_type!r}; supported: {list(SUPPORTED_MODEL_TYPES)}{moe}")
    for field, ok in (
        ("hidden_act", "silu"),
        ("attention_bias", False),
        ("mlp_bias", False),
        ("use_sliding_window", False),
    ):
        if raw.get(field, ok) != ok:
            refuse(field, f"is {raw[field]!r}; Gyre's trainer and engine implement only {ok!r}")
    if model_type == "llama" and raw.get("sliding_window") is not None:
        refuse("sliding_window", f"is {raw['sliding_window']!r}; only full attention is implemented")
    if any(t != "full_attention" for t in raw.get("layer_types") or []):
        refuse("layer_types", "has non-full-attention layers; only full attention is implemented")
    if raw.get("num_experts") or raw.get("num_local_experts"):
        refuse("num_experts", f"is set; {MOE_REFUSED}")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_field = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        refuse(
            f"{rope_field}.rope_type",
            f"is {rope.get('rope_type', rope.get('type'))!r}; only unscaled ('default') RoPE is implemented",
        )
    if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        refuse("partial_rotary_factor", "is not 1.0; only full-width RoPE is implemented")
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    heads = raw["num_attention_heads"]
    fields = {
        "num_layers": raw["num_hidden_layers"],
        "hidden_size": raw["hidden_size"],
        "ffn_hidden_size": raw["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": raw.get("num_key_value_heads") or heads,
        "head_dim": raw.get("head_dim") or raw["hidden_size"] // heads,
        "qk_norm": model_type == "qwen3",
        "vocab_size": raw["vocab_size"],
        "max_seq_len": raw.get("max_position_embeddings", 4096),
        "rotary_base": float(theta),
        "norm_epsilon": float(raw.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
    }
    if float(theta) != int(theta):
        refuse("rope_theta", f"is {theta!r}; megatron-core takes an integer rotary base")
    return fields


def read_hf_config(path: str | os.PathLike) -> dict:
    """ModelConfig fields from `path`/config.json (see `hf_config_fields`)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ConfigError("path", f"{f} not found: a Hugging Face model directory needs config.json")
    try:
        raw = jsonio.loads(f.read_text())
    except (OSError, jsonio.DecodeError) as e:
        raise ConfigError("path", f"{f} is not readable JSON: {e}") from None
    try:
        return hf_config_fields(raw, str(f))
    except KeyError as e:
        raise ConfigError("path", f"{f}: required field {e.args[0]!r} missing") from None


def hf_config_of(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """A config.json for `cfg` that `transformers` loads (qwen3 with q/k norm, else llama)."""
    model_type = "qwen3" if cfg.qk_norm else "llama"
    return {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base},
        "rope_theta": cfg.rotary_base,
        "rms_norm_eps": cfg.norm_epsilon,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "use_sliding_window": False,
        "dtype": dtype,
    }


def read_hf_weights(path: str | os.PathLike, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Engine-named fp32 tensors from `path`'s safetensors (one file or shards); a tied model's
    `lm_head.weight`, if the file has it, and RoPE buffers are dropped."""
    d = Path(path)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d} has no *.safetensors weights")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight"):
                    continue
                out[engine_name(name)] = st.get_tensor(name).to(torch.float32)
    return out


def hf_name(engine_name: str) -> str:
    """The checkpoint (and SGLang parameter) name of an engine-named tensor."""
    return engine_name if engine_name == "lm_head.weight" else "model." + engine_name


def engine_name(name: str) -> str:
    """The engine name of a checkpoint (SGLang parameter) name: `hf_name`'s inverse."""
    return name.removeprefix("model.")


def write_hf_dir(
    path: str | os.PathLike,
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    dtype: str = "float32",
    source: str | os.PathLike | None = None,
) -> None:
    """Write `weights` (engine names) as an HF directory: model.safetensors in `dtype`, and either
    `source`'s non-weight files (its config.json, tokenizer and generation config, verbatim) or a
    generated config.json. Each file goes to a temp name first and is renamed into place."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = _DTYPES[dtype]
    tensors = {hf_name(n): t.detach().to(torch_dtype).contiguous().cpu() for n, t in weights.items()}
    with atomic_path(out / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    if source is None:
        write_atomic(out / "config.json", jsonio.dumps(hf_config_of(cfg, dtype), indent=1))
        return
    for f in sorted(Path(source).iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES):
            with atomic_path(out / f.name) as tmp:
                shutil.copyfile(f, tmp)


def source_dtype(path: str | os.PathLike) -> str:
    """The dtype an HF directory stores its weights in (config.json `dtype`/`torch_dtype`)."""
    raw = jsonio.loads((Path(path) / "config.json").read_text())
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return dtype if dtype in _DTYPES else "float32"
