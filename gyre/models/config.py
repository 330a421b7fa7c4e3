"""Architecture of a Qwen-like decoder (RMSNorm, SwiGLU, RoPE, grouped-query attention, optional
per-head q/k RMSNorm as in Qwen3).

One config drives both the trainer's megatron-core GPTModel and the builtin engine's forward, so
their parameters map one to one. With `path` set (conf/model/hf.yaml: `model=hf model.path=DIR`)
the shapes come from the Hugging Face checkpoint's config.json and the weights from its
safetensors; an architecture Gyre cannot run exactly fails here, naming the config.json field.
"""

from dataclasses import dataclass

from gyre.errors import require


@dataclass(kw_only=True)
class ModelConfig:
    """Shapes of the decoder; `tiny` (conf/model/tiny.yaml) has a few M parameters for CPU runs."""

    name: str = "tiny"
    path: str | None = None
    """Hugging Face checkpoint directory (config.json, safetensors, tokenizer files); when set, its
    config.json replaces every shape field below and the trainer and engine load its weights."""
    num_layers: int = 2
    hidden_size: int = 128
    ffn_hidden_size: int = 384
    """SwiGLU inner width (per gate)."""
    num_attention_heads: int = 4
    num_query_groups: int = 2
    """KV heads (grouped-query attention); must divide num_attention_heads."""
    head_dim: int = 0
    """Per-head width; 0 means hidden_size // num_attention_heads (Qwen3 sets it explicitly)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3)."""
    vocab_size: int = 512
    max_seq_len: int = 4096
    """Context window in tokens (prompt + generation)."""
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-6
    tie_embeddings: bool = False
    """Share the input embedding with the output layer."""

    def __post_init__(self):
        if self.path is not None:
            from gyre.models.hf import read_hf_config

            for key, value in read_hf_config(self.path).items():
                setattr(self, key, value)
        require(self.num_layers >= 1, "num_layers", f"must be >= 1, got {self.num_layers}")
        require(self.hidden_size >= 1, "hidden_size", f"must be >= 1, got {self.hidden_size}")
        require(self.vocab_size >= 2, "vocab_size", f"must be >= 2, got {self.vocab_size}")
        require(self.max_seq_len >= 2, "max_seq_len", f"must be >= 2, got {self.max_seq_len}")
        require(self.num_attention_heads >= 1, "num_attention_heads", f"must be >= 1, got {self.num_attention_heads}")
        if self.head_dim == 0:
            require(
                self.hidden_size % self.num_attention_heads == 0,
                "num_attention_heads",
                f"must divide hidden_size={self.hidden_size} (or set head_dim), got {self.num_attention_heads}",
            )
            self.head_dim = self.hidden_size // self.num_attention_heads
        require(
            self.head_dim >= 2 and self.head_dim % 2 == 0,
            "head_dim",
            f"must be even and >= 2 (RoPE halves), got {self.head_dim}",
        )
        require(
            self.num_query_groups >= 1 and self.num_attention_heads % self.num_query_groups == 0,
            "num_query_groups",
            f"must divide num_attention_heads={self.num_attention_heads}, got {self.num_query_groups}",
        )

    def same_architecture(self, other: "ModelConfig") -> bool:
        """Equal shapes (name and path aside): weights of one fit the other."""
        skip = {"name", "path"}
        return all(getattr(self, f) == getattr(other, f) for f in self.__dataclass_fields__ if f not in skip)
