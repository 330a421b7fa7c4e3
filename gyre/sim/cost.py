"""The simulator's cost model from first principles: FLOPs per token at the actual context, x MFU.

Training and prefill are compute-bound, so their throughput follows from the FLOPs a token costs
at the context it sees and the fraction of peak the GPUs reach (MFU, a preset assumption):

    training, per trained token, a sequence of length L (causal attention averages L/2 per query):
        forward 2 N + 2 n_attn d L  (N active parameters; n_attn full-attention layers of query
        width d: QK^T and AV, 2 FLOPs per multiply-add each), backward 2x forward -> 3x forward,
        plus the log-prob recompute under the behaviour weights (one forward) and an optional
        reference-model forward (KL)
    prefill, per new prompt token at context L (it attends to the whole context):
        2 N + 4 n_attn d L

Decode is memory-bound, so its throughput stays a measured preset figure. Weight sync is bytes /
bandwidth. A preset value > 0 for a throughput overrides the derived one (a live run's measurement).
"""

from dataclasses import dataclass

from gyre.sim.config import PresetConfig, ProfileConfig
from gyre.sim.workload import context_tokens, draw_batch, mean_context_tokens


@dataclass(frozen=True)
class Costs:
    """Per-node throughputs and fixed times one simulated run charges."""

    train_tok_s_per_node: float
    prefill_tok_s_per_node: float
    optimizer_step_s: float
    """Optimizer step plus publishing the new weights to the engines, seconds."""
    train_context_tokens: float
    """Token-weighted mean trained sequence length the attention term is charged at."""
    prefill_context_tokens: float
    """Mean context a new prompt token attends to (a model call's mean context)."""
    train_flops_per_token: float
    train_mfu_implied: float
    """MFU the training throughput implies (the assumption when derived; a check when measured)."""


def train_flops_per_token(preset: PresetConfig, seq_tokens: float) -> float:
    """FLOPs one trained token costs at sequence length `seq_tokens` (passes included)."""
    n = preset.active_params_b * 1e9
    attn = preset.attention_layers * preset.attention_dim
    forward = 2 * n + 2 * attn * seq_tokens
    passes = 3 + int(preset.logprob_recompute) + int(preset.reference_pass)  # fwd+bwd = 3 forwards
    return forward * passes


def prefill_flops_per_token(preset: PresetConfig, context: float) -> float:
    """FLOPs one prompt token costs to prefill at context `context`."""
    return 2 * preset.active_params_b * 1e9 + 4 * preset.attention_layers * preset.attention_dim * context


def trained_context_tokens(profile: ProfileConfig, seed: int) -> float:
    """Token-weighted mean final context over step 0's draw: attention cost per token grows with
    the sequence it belongs to, so long executions weigh in proportion to their tokens."""
    b = draw_batch(profile, 0, seed)
    ctx = [context_tokens(profile, n) for n in b.segments]
    return sum(c * c for c in ctx) / max(1.0, sum(ctx))


def derive_costs(profile: ProfileConfig, preset: PresetConfig, seed: int) -> Costs:
    """The run's throughputs: measured preset values where given (> 0), else from FLOPs x MFU."""
    peak = preset.gpus_per_node * preset.gpu_peak_tflops * 1e12
    l_train = trained_context_tokens(profile, seed)
    l_prefill = mean_context_tokens(profile, seed)
    f_train = train_flops_per_token(preset, l_train)
    train = preset.train_tok_s_per_node or peak * preset.train_mfu / f_train
    prefill = preset.prefill_tok_s_per_node or peak * preset.prefill_mfu / prefill_flops_per_token(preset, l_prefill)
    opt = preset.optimizer_step_s or preset.optimizer_s + preset.weight_gb / preset.weight_sync_gb_s
    return Costs(
        train_tok_s_per_node=train,
        prefill_tok_s_per_node=prefill,
        optimizer_step_s=opt,
        train_context_tokens=l_train,
        prefill_context_tokens=l_prefill,
        train_flops_per_token=f_train,
        train_mfu_implied=train * f_train / peak,
    )
