"""Does megatron-core's pipeline parallel run on CPU (gloo, the local layer spec, Gyre's CPU shim)?
Runs the tiny model's shape with 4 layers as 2 pipeline stages (2 gloo ranks) through megatron's 1F1B
schedule (`get_forward_backward_func`) for 4 micro-batches, and the same weights and micro-batches
unpipelined in one rank; prints one JSON line: the loss and the largest gradient difference of any
parameter between the two. Gyre's trainer does not use the pipeline schedules (gyre/train/ranks.py).

    .venv/bin/python tools/probe/pp_cpu.py [--patch]
"""

import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gyre.common import jsonio
from gyre.common.ports import PortReservation
from gyre.train.cpu_shim import apply_cpu_shim

LAYERS, STAGES, MICRO, SEQ = 4, 2, 4, 32
PATCH = "--patch" in sys.argv


def _model(pp: int, pre: bool, post: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=128,
        ffn_hidden_size=384,
        num_attention_heads=4,
        num_query_groups=2,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
    )
    spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(cfg, spec, vocab_size=1024, max_sequence_length=SEQ, pre_process=pre, post_process=post)


def _batches() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [{"tokens": torch.randint(0, 1024, (1, SEQ + 1), generator=gen)} for _ in range(MICRO)]


MASK, POS = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None], torch.arange(SEQ)[None]


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.main_grad if hasattr(p, "main_grad") else p.grad for n, p in model.named_parameters()}


def _unpipelined(model) -> tuple[float, dict[str, torch.Tensor]]:
    """The reference: each micro-batch's mean token loss / MICRO, back-propagated in turn."""
    total = 0.0
    for batch in _batches():
        tokens = batch["tokens"]
        loss = model(tokens[:, :-1], POS, MASK, labels=tokens[:, 1:]).float().mean() / MICRO
        loss.backward()
        total += loss.item()
    return total, _grads(model)


def _pipelined(model) -> tuple[float | None, dict[str, torch.Tensor]]:
    """The same through megatron's schedule for this rank's stage (its 1F1B with 2 stages)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data, model):
        tokens = next(data)["tokens"]
        out = model(tokens[:, :-1], POS, MASK, labels=tokens[:, 1:])
        return out, lambda loss: (loss.float().mean(), {"loss": loss.float().mean().detach()})

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(_batches()),
        model=[model],
        num_microbatches=MICRO,
        seq_length=SEQ,
        micro_batch_size=1,
    )
    loss = sum(x["loss"].item() for x in losses) / MICRO if losses else None
    return loss, _grads(model)


def _global(name: str, stage: int) -> str:
    """A stage's parameter name in the unpipelined model (its layers come after earlier stages')."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + stage * LAYERS // STAGES)
    return ".".join(parts)


class _CpuTorch:
    """`torch` as megatron's schedules module sees it with `--patch`: a literal device="cuda" becomes
    the CPU (the one thing Gyre's shim cannot redirect: a string, not a call)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _rank(rank: int, port: int, tmp: str, patch: bool) -> None:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    if patch:
        schedules.torch = _CpuTorch()
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    apply_cpu_shim()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=STAGES)
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=STAGES)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
    model = _model(STAGES, pre=rank == 0, post=rank == STAGES - 1)
    full = torch.load(Path(tmp) / "weights.pt")
    model.load_state_dict({n: full[_global(n, rank)] for n in model.state_dict()}, strict=False)
    loss, grads = _pipelined(model)
    torch.save({"loss": loss, "grads": {_global(n, rank): g for n, g in grads.items()}}, Path(tmp) / f"r{rank}.pt")
    dist.destroy_process_group()


def main() -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    out = {"megatron_core": __import__("megatron.core").core.__version__, "stages": STAGES, "patched": PATCH}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            apply_cpu_shim()
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            parallel_state.initialize_model_parallel()
            model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
            model = _model(1, pre=True, post=True)
            torch.save(model.state_dict(), Path(tmp) / "weights.pt")
            ref_loss, ref = _unpipelined(model)
            with PortReservation() as port:  # until its rank 0 binds the group's store
                mp.start_processes(_rank, args=(port, tmp, PATCH), nprocs=STAGES, start_method="spawn")
            stages = [torch.load(Path(tmp) / f"r{r}.pt") for r in range(STAGES)]
            grads = {n: g for s in stages for n, g in s["grads"].items()}
            out |= {
                "runs": True,
                "loss_pipelined": stages[-1]["loss"],
                "loss_unpipelined": ref_loss,
                "params_covered": sorted(grads) == sorted(ref),
                "max_grad_diff": max((grads[n] - ref[n]).abs().max().item() for n in ref if n in grads),
            }
        except Exception as e:  # the finding is the failure: print it
            out |= {"runs": False, "error": f"{type(e).__name__}: {e}", "where": traceback.format_exc()[-1500:]}
    print(jsonio.dumps(out))


if __name__ == "__main__":
    main()
