"""Build the megatron-core GPTModel for a ModelConfig, and the process groups it runs in.

CPU: gloo, fp32, the local layer spec and the shim of gyre/train/cpu_shim.py. CUDA (untested here:
no GPU on the development machines): NCCL, the TransformerEngine layer spec when
`transformer_engine` imports, bf16 autocast in the trainer. Parameters are re-pointed into one flat
fp32 buffer (`FlatParams`) so the core can publish a step's weights as one registered region and a
satellite can pull them with one transfer, with no packing copy on either side.

With `model.path` set, `build_gpt_model` loads the Hugging Face checkpoint's weights, each rank
taking its tensor-parallel shard (`shard_for_rank`), so every consumer of the model starts from them.
"""

import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gyre.errors import GyreError
from gyre.models.config import ModelConfig
from gyre.models.convert import engine_to_megatron, local_spec_name
from gyre.train.config import TrainerConfig
from gyre.train.cpu_shim import apply_cpu_shim


class ParallelError(GyreError):
    """The process layout does not fit the trainer config."""


def init_distributed(tensor_parallel_size: int, seed: int, timeout_s: float | None = None) -> None:
    """Initialise torch.distributed (if the launcher has not) and Megatron's model-parallel groups.

    Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment (none set: one rank,
    with an in-memory store). The cell's ranks form world / TP data-parallel replicas. A collective
    that waits over `timeout_s` raises (None: torch's default), so a hung rank cannot hold the
    others forever (`trainer.collective_timeout_s`).

    Raises:
        ParallelError: the world size is not a multiple of the tensor-parallel size.
    """
    cpu = apply_cpu_shim()  # first: it imports megatron-core for CPU
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        if not cpu:
            torch.cuda.set_device(local_device(rank))
        backend = "gloo" if cpu else "nccl"
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        if world == 1:  # a one-rank cell needs no rendezvous port (and must not inherit its parent's)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    if dist.get_world_size() % tensor_parallel_size:
        raise ParallelError(
            f"trainer.tensor_parallel_size={tensor_parallel_size} does not divide the cell's "
            f"{dist.get_world_size()} ranks"
        )
    if not parallel_state.model_parallel_is_initialized():
        minutes = 30 if timeout_s is None else math.ceil(timeout_s / 60)  # megatron-core's groups: whole minutes
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel_size, distributed_timeout_minutes=minutes
        )
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=cpu, force_reset_rng=True)


def local_device(rank: int) -> int:
    """This rank's CUDA device: LOCAL_RANK, which a Slurm task exports from its cell's plan
    (gyre.cells.serving.plan_cell, checked against SLURM_LOCALID); unset, the ranks share one
    machine (spawned by gyre.train.ranks) and the rank is its local rank.

    Raises:
        ParallelError: the device is not one this process sees (a site binding GPUs per task).
    """
    device = int(os.environ.get("LOCAL_RANK", rank))
    if device >= torch.cuda.device_count():
        raise ParallelError(
            f"rank {rank} is planned on CUDA device {device}, and this process sees {torch.cuda.device_count()} "
            "(CUDA_VISIBLE_DEVICES): every task of a node must see all of the node's GPUs (cluster.gpus_per_node)"
        )
    return device


def use_device(device: torch.device) -> None:
    """Make a rank's CUDA `device` current in the calling thread, which starts on device 0 whatever
    the main thread set: megatron-core and torch's object collectives allocate on the current device,
    and NCCL binds a communicator to it. A thread that drives the trainer calls this first."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def build_gpt_model(model_cfg: ModelConfig, cfg: TrainerConfig):
    """The policy as a megatron-core GPTModel (RMSNorm, SwiGLU, RoPE, GQA, no biases), fp32 params.

    Raises:
        ParallelError: heads, KV groups or vocabulary do not split over the TP ranks.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    tp = cfg.tensor_parallel_size
    for key, value in (("num_query_groups", model_cfg.num_query_groups), ("vocab_size", model_cfg.vocab_size)):
        if value % tp:
            raise ParallelError(f"model.{key}={value} does not split over trainer.tensor_parallel_size={tp}")
    cuda = torch.cuda.is_available()
    tcfg = TransformerConfig(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        kv_channels=model_cfg.head_dim,
        tensor_model_parallel_size=tp,
        normalization="RMSNorm",
        layernorm_epsilon=model_cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        use_cpu_initialization=not cuda,
        perform_initialization=True,
        # Fused kernels are CUDA-only; on GPUs they are numerically equivalent but faster.
        bias_activation_fusion=cuda,
        masked_softmax_fusion=cuda,
        persist_layer_norm=False,
        bias_dropout_fusion=cuda,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        qk_layernorm=model_cfg.qk_norm,
    )
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=_layer_spec(cuda, model_cfg.qk_norm),
        vocab_size=model_cfg.vocab_size,
        max_sequence_length=model_cfg.max_seq_len,
        position_embedding_type="rope",
        rotary_base=int(model_cfg.rotary_base),
        rotary_percent=1.0,
        share_embeddings_and_output_weights=model_cfg.tie_embeddings,
        parallel_output=True,
    )
    if model_cfg.path is not None:
        from gyre.models.hf import read_hf_weights

        load_full_weights(model, model_cfg, read_hf_weights(model_cfg.path, model_cfg))
    return model


def _layer_spec(cuda: bool, qk_layernorm: bool):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if cuda:
        try:
            import transformer_engine  # noqa: F401  (probe only)

            return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
        except ImportError:
            pass
    return specs.get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")


def shard_for_rank(name: str, full: torch.Tensor, param: torch.nn.Parameter, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's part of a full Megatron tensor (the inverse of the trainer's all-gather).

    Column- and row-parallel weights split along `partition_dim`; fc1 is [gate; up], so each rank
    takes [gate_r; up_r]; the fused qkv rows are grouped per KV group, so contiguous rows split
    whole groups. Replicated parameters (norms) are returned whole.
    """
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    return full.chunk(tp, dim=param.partition_dim)[rank]


def load_full_weights(model: torch.nn.Module, model_cfg: ModelConfig, engine_weights: dict[str, torch.Tensor]) -> None:
    """Copy full engine-named weights into `model`, each rank its TP shard.

    Raises:
        ConversionError: a tensor is missing or mis-shaped for `model_cfg`.
        ParallelError: the model has a parameter the conversion does not produce.
    """
    from megatron.core import parallel_state

    state = engine_to_megatron(engine_weights, model_cfg)  # local-spec names; a TE model's are mapped to them
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = state.get(local_spec_name(name))
            if full is None:
                raise ParallelError(f"the converted checkpoint has no tensor for model parameter {name!r}")
            param.copy_(shard_for_rank(name, full, param, tp, rank))


@dataclass
class FlatParams:
    """All trainable parameters as views of one contiguous fp32 buffer, in `named_parameters` order."""

    names: tuple[str, ...]
    params: tuple[torch.nn.Parameter, ...]
    weights: torch.Tensor
    """[N] the flat buffer; each parameter's `.data` is a view of it."""

    @staticmethod
    def adopt(model: torch.nn.Module) -> "FlatParams":
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        total = sum(p.numel() for _, p in named)
        flat = torch.empty(total, dtype=torch.float32, device=named[0][1].device)
        offset = 0
        for _, p in named:
            view = flat[offset : offset + p.numel()].view_as(p)
            view.copy_(p.data)
            p.data = view
            offset += p.numel()
        return FlatParams(tuple(n for n, _ in named), tuple(p for _, p in named), flat)

    def signature(self) -> list[tuple[str, tuple[int, ...]]]:
        """Names and shapes: a satellite's model must match the core's before it pulls bytes."""
        return [(n, tuple(p.shape)) for n, p in zip(self.names, self.params)]

    def gather_grads(self, out: torch.Tensor) -> torch.Tensor:
        """Copy each parameter's gradient into the flat `out` (zeros where a parameter got none)."""
        offset = 0
        for p in self.params:
            n = p.numel()
            if p.grad is None:
                out[offset : offset + n].zero_()
            else:
                out[offset : offset + n].copy_(p.grad.reshape(-1))
            offset += n
        return out

    def set_grads(self, flat_grad: torch.Tensor) -> None:
        """Point each parameter's `.grad` at its slice of `flat_grad` (no copy)."""
        offset = 0
        for p in self.params:
            p.grad = flat_grad[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
