"""The memory of one GPU of a cell, planned from the config before anything starts (pure).

Each GPU holds one trainer rank and belongs to one engine (gyre.cells.serving.plan_cell); the two
take turns as the cell's role changes. The plan counts what Gyre's own code allocates on the GPU:

    trainer (megatron-core GPTModel, TP = trainer.tensor_parallel_size, DP = the cell's other ranks)
      weights      fp32 FlatParams (gyre.train.model): 4 B per parameter of the rank's TP shard
      gradients    each parameter's .grad (backward), the flat `Trainer.grad`, `fold`'s sum and, with
                   DP > 1, its broadcast buffer: 4 B each
      grad_slots   the core's satellite slots and accumulator (gyre.train.shard), only with satellites:
                   (trainer.num_grad_slots + 1) x 4 B
      optimizer    AdamW's two fp32 moments, sharded over DP (ZeroRedundancyOptimizer): 8 B / DP
      activations  what backward keeps at coordinator.max_micro_batch_tokens tokens (bf16 layer inputs
                   and outputs, flash attention's q/k/v/out, fp32 logits and their softmax) plus
                   autocast's bf16 copy of the weights
      context      CUDA context, NCCL and cuBLAS workspaces (an estimate)
    engine (SGLang, TP = engine.tp_size)
      weights      2 B (bf16) per parameter of its shard (KV heads replicated when tp_size > KV heads)
      kv           what SGLang's pool takes: mem_fraction_static x capacity - weights
      runtime      context, CUDA graphs, prefill activations: outside the static fraction (an estimate)

A role fits when its holder and what the other keeps fit the GPU: training holds the trainer and a
released engine's runtime; serving holds the engine and an offloaded trainer's context (the
trainer's state leaves the GPU while the cell serves: DESIGN "A cell's GPU belongs to its role").
docs/slurm.md ("GPU cells") compares these formulas with megatron-core's and SGLang's own.
"""

from dataclasses import dataclass, field

from gyre.common import jsonio
from gyre.models.config import ModelConfig

BF16, FP32 = 2, 4
TRAINER_CONTEXT_BYTES = 1_500_000_000
"""CUDA context (~0.5 GB with torch's kernels), NCCL communicators' buffers, cuBLAS workspaces."""
ENGINE_RUNTIME_BYTES = 3_000_000_000
"""SGLang outside its static pool: CUDA context, CUDA graphs, prefill activations (chunked prefill)."""


@dataclass(frozen=True, kw_only=True)
class GpuShape:
    """What the plan needs from the config (gyre.launch.plan reads it from a GyreConfig)."""

    model: ModelConfig
    trainer_tp: int
    data_parallel: int
    core_slots: int
    """Gradient slots the core holds for satellites (0: no satellites)."""
    micro_batch_tokens: int
    engine_tp: int
    engine_on_gpu: bool
    mem_fraction_static: float
    context_len: int
    capacity_bytes: int


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes on one GPU by part, whether each role fits, and the keys to change where not."""

    trainer: dict[str, int]
    engine: dict[str, int]
    capacity_bytes: int
    kv_tokens: int
    problems: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def training_bytes(self) -> int:
        return sum(self.trainer.values()) + self.engine["runtime"]

    @property
    def serving_bytes(self) -> int:
        return sum(self.engine.values()) + self.trainer["context"]


def rank_params(cfg: ModelConfig, tp: int, replicate_kv: bool = False) -> int:
    """Parameters one of `tp` tensor-parallel ranks holds (Megatron's and SGLang's split: heads, ffn
    and vocabulary sharded, norms replicated); `replicate_kv`: KV heads below tp are replicated
    (SGLang), else they must divide (Megatron)."""
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    kv_heads = max(1, cfg.num_query_groups // tp) if replicate_kv else cfg.num_query_groups // tp
    attention = (cfg.num_attention_heads // tp * 2 + kv_heads * 2) * d * h  # q and o, k and v
    norms = 2 * h + (2 * d if cfg.qk_norm else 0)
    layer = attention + 3 * (f // tp) * h + norms
    vocab = -(-cfg.vocab_size // tp) * h * (1 if cfg.tie_embeddings else 2)
    return cfg.num_layers * layer + vocab + h


def activation_bytes(cfg: ModelConfig, tp: int, tokens: int) -> int:
    """What backward keeps for `tokens` tokens of one micro-batch, without recomputation or sequence
    parallelism (Korthikanti et al. 2022's accounting, for SwiGLU, GQA and flash attention)."""
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    a, g = cfg.num_attention_heads // tp, max(1, cfg.num_query_groups // tp)
    per_token_layer = BF16 * (4 * h + (a + 2 * g) * d + a * d + 3 * f // tp)  # norms' in/out, qkv, out, fc1, swiglu
    if cfg.qk_norm:
        per_token_layer += BF16 * (a + g) * d
    logits = 2 * FP32 * -(-cfg.vocab_size // tp)  # fp32 logits and their softmax
    return tokens * (cfg.num_layers * per_token_layer + logits + BF16 * h)


def kv_bytes_per_token(cfg: ModelConfig, tp: int) -> int:
    """SGLang's KV pool cell: k and v of every layer, its share of the KV heads (replicated below tp), bf16."""
    return 2 * cfg.num_layers * max(1, cfg.num_query_groups // tp) * cfg.head_dim * BF16


def plan_memory(shape: GpuShape) -> MemoryPlan:
    """The plan of one GPU (see the module doc); the core's GPU, the fullest of the cell's.

    Returns:
        the plan; `problems` says what does not fit, `keys` the config keys that change it.
    """
    m, dp = shape.model, shape.data_parallel
    local = rank_params(m, shape.trainer_tp)
    grad_buffers = 3 + (dp > 1)
    trainer = {
        "weights": FP32 * local,
        "gradients": FP32 * grad_buffers * local,
        "grad_slots": FP32 * (shape.core_slots + 1) * local if shape.core_slots else 0,
        "optimizer": 2 * FP32 * local // dp,
        "activations": activation_bytes(m, shape.trainer_tp, shape.micro_batch_tokens) + BF16 * local,
        "context": TRAINER_CONTEXT_BYTES,
    }
    engine, kv_tokens = _engine_bytes(shape)
    plan = MemoryPlan(trainer, engine, shape.capacity_bytes, kv_tokens)
    _check(plan, shape)
    return plan


def _engine_bytes(shape: GpuShape) -> tuple[dict[str, int], int]:
    if not shape.engine_on_gpu:  # the builtin engine serves from CPU memory
        return {"weights": 0, "kv": 0, "runtime": 0}, 0
    weights = BF16 * rank_params(shape.model, shape.engine_tp, replicate_kv=True)
    kv = max(0, int(shape.mem_fraction_static * shape.capacity_bytes) - weights)
    return {"weights": weights, "kv": kv, "runtime": ENGINE_RUNTIME_BYTES}, kv // kv_bytes_per_token(
        shape.model, shape.engine_tp
    )


def _check(plan: MemoryPlan, shape: GpuShape) -> None:
    """Fill the plan's problems and the keys that address them."""
    m, tp, cap = shape.model, shape.trainer_tp, shape.capacity_bytes

    def problem(text: str, *keys: str) -> None:
        plan.problems.append(text)
        plan.keys.extend(k for k in keys if k not in plan.keys)

    for key, value in (("num_query_groups", m.num_query_groups), ("vocab_size", m.vocab_size)):
        if value % tp:
            problem(f"model.{key}={value} does not split over {tp} TP ranks", "trainer.tensor_parallel_size")
    if plan.training_bytes > cap:
        keys = ["trainer.tensor_parallel_size", "cluster.cell_nodes", "cluster.gpus_per_node"]
        if plan.trainer["activations"] > 0.1 * plan.training_bytes:
            keys.append("coordinator.max_micro_batch_tokens")
        if plan.trainer["grad_slots"]:
            keys.append("trainer.num_grad_slots")
        problem(f"training needs {_gb(plan.training_bytes)} of the GPU's {_gb(cap)}", *keys)
    if shape.engine_on_gpu and plan.kv_tokens < shape.context_len:
        problem(
            f"the engine's KV pool holds {plan.kv_tokens} tokens, less than one context "
            f"(proxy.context_len={shape.context_len})",
            "engine.tp_size",
            "engine.mem_fraction_static",
        )
    if plan.serving_bytes > cap:
        problem(f"serving needs {_gb(plan.serving_bytes)} of the GPU's {_gb(cap)}", "engine.mem_fraction_static")


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def render_plan(plan: MemoryPlan, ranks_per_node: int, devices: list[int | None]) -> list[str]:
    """The lines `gyre-plan` prints: a table by part, the verdict, and last one JSON object."""
    lines = [f"{'part':<14}{'trainer GB':>12}{'engine GB':>12}"]
    for part in dict.fromkeys([*plan.trainer, *plan.engine]):
        t, e = plan.trainer.get(part), plan.engine.get(part)
        lines.append(f"{part:<14}{_col(t):>12}{_col(e):>12}")
    lines.append(f"{'total':<14}{_col(sum(plan.trainer.values())):>12}{_col(sum(plan.engine.values())):>12}")
    lines.append(
        f"GPU {_gb(plan.capacity_bytes)}: training holds {_gb(plan.training_bytes)}, serving "
        f"{_gb(plan.serving_bytes)}; engine KV {plan.kv_tokens} tokens"
    )
    lines += [f"does not fit: {p}" for p in plan.problems]
    if plan.keys:
        lines.append(f"change: {', '.join(plan.keys)}")
    summary = {
        "ranks_per_node": ranks_per_node,
        "devices": devices,
        "gpu_bytes": {"trainer": plan.trainer, "engine": plan.engine},
        "gpu_capacity_bytes": plan.capacity_bytes,
        "training_bytes": plan.training_bytes,
        "serving_bytes": plan.serving_bytes,
        "engine_kv_tokens": plan.kv_tokens,
        "fits": plan.fits,
        "keys": plan.keys,
    }
    return [*lines, jsonio.dumps(summary)]


def _col(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.2f}"
