"""Architecture of a Qwen-like decoder (RMSNorm, SwiGLU, RoPE, grouped-query attention).

One config drives both the trainer's megatron-core GPTModel and the builtin engine's forward, so
their parameters map one to one.
"""

from dataclasses import dataclass

from gyre.errors import require


@dataclass(kw_only=True)
class ModelConfig:
    """Shapes of the decoder; `tiny` (conf/model/tiny.yaml) has a few M parameters for CPU runs."""

    name: str = "tiny"
    num_layers: int = 2
    hidden_size: int = 128
    ffn_hidden_size: int = 384
    """SwiGLU inner width (per gate)."""
    num_attention_heads: int = 4
    num_query_groups: int = 2
    """KV heads (grouped-query attention); must divide num_attention_heads."""
    vocab_size: int = 512
    max_seq_len: int = 4096
    """Context window in tokens (prompt + generation)."""
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-6
    tie_embeddings: bool = False
    """Share the input embedding with the output layer."""

    def __post_init__(self):
        require(self.num_layers >= 1, "num_layers", f"must be >= 1, got {self.num_layers}")
        require(self.hidden_size >= 1, "hidden_size", f"must be >= 1, got {self.hidden_size}")
        require(self.vocab_size >= 2, "vocab_size", f"must be >= 2, got {self.vocab_size}")
        require(self.max_seq_len >= 2, "max_seq_len", f"must be >= 2, got {self.max_seq_len}")
        require(
            self.num_attention_heads >= 1 and self.hidden_size % self.num_attention_heads == 0,
            "num_attention_heads",
            f"must divide hidden_size={self.hidden_size}, got {self.num_attention_heads}",
        )
        require(
            self.num_query_groups >= 1 and self.num_attention_heads % self.num_query_groups == 0,
            "num_query_groups",
            f"must divide num_attention_heads={self.num_attention_heads}, got {self.num_query_groups}",
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads
