"""GPU acceptance check (one H100 or H200; tools/gpu_check.sh gives it 210 s): the megatron trainer
in bf16 on CUDA (NCCL, one rank) and the builtin engine's forward on CUDA, both loading one random
HF-format Qwen3 checkpoint.

Checks, printed as one JSON line (`ok` is their conjunction):
  fp32: engine vs `transformers` log-probs, max |diff| <= 1e-3 (TF32 off);
  bf16: trainer (autocast) vs engine (bf16 weights) and vs `transformers` (bf16), mean |diff| <= 0.02
        and max |diff| <= 0.5 nats. bf16 keeps 8 mantissa bits, so two correct implementations that
        round in different places differ by ~1e-2 per log-prob on average, with rare tails near 0.3.
  one RL step: the trainer's step changes the weights; they are handed to the engine (the same
        `EngineCore.update_weights` the HTTP update endpoints call) and the engine's log-probs
        follow the trainer's again within the bf16 tolerance.
  cpu step: the same fp32 train step (TF32 off) from the same checkpoint and batch, run by this
        script in two child processes, one on CUDA and one with CUDA hidden (the CPU trainer, gloo):
        log-probs before and after the step max |diff| <= 1e-3 (the fp32 bound above) and the
        grad norm within 1e-4 relative; the weights' largest difference is reported, not checked
        (Adam's first step moves a weight by about lr whatever its gradient's size, so a gradient
        near Adam's eps may round to another move on the two devices).
  plan: gyre-plan's bytes (gyre.launch.memory) against `torch.cuda.memory_allocated` for the same
        shape: the trainer's weights and its gradient buffer after it is built, Adam's moments
        after the step (each within 5%: they are exact counts), and what the step added at its peak
        against the plan's activations, step-time gradient buffers and moments (reported, not
        checked: the activations are an estimate; `plan_peak_ratio`).
Run by tools/gpu_check.sh; never run on the CPU machines (no CUDA there), except its CPU step:
`python tools/gpu_check.py --step CHECKPOINT_DIR OUT.pt` (what the cpu-step check runs twice).
"""

import os
import subprocess
import sys
import tempfile
import time

import torch

from gyre.common import jsonio


def _lp(logits, ids):
    return torch.log_softmax(logits.float(), -1).gather(1, ids[1:, None]).squeeze(1)


SHAPE = dict(
    vocab_size=32768,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)
"""The random Qwen3 checkpoint every check loads."""
TOKENS = 1024


def token_ids() -> torch.Tensor:
    """The one sequence every check computes (the same in every process)."""
    return torch.randint(0, SHAPE["vocab_size"], (TOKENS,), generator=torch.Generator().manual_seed(1))


def packed(ids: torch.Tensor, behaviour: torch.Tensor, adv: float):
    """`ids` as one packed sequence, every token after the first a target with advantage `adv`."""
    from gyre.trajectory.sample import PackedBatch

    n = len(ids)
    mask = torch.arange(n) > 0
    return PackedBatch(
        tokens=ids.cpu(),
        position_ids=torch.arange(n),
        cu_seqlens=torch.tensor([0, n], dtype=torch.int32),
        target_mask=mask,
        behaviour_logprobs=behaviour.cpu(),
        loss_weights=mask.float(),
        advantages=torch.full((n,), adv),
        weight_versions=torch.zeros(n, dtype=torch.int64),
        execution_ids=("g",),
    )


def fp32_step(checkpoint: str, out_path: str) -> None:
    """One fp32 train step (on policy: its own log-probs as the behaviour's) of a trainer loading
    `checkpoint`, on CUDA where this process sees it, else on CPU; saves the log-probs before and
    after, the grad norm and the weights to `out_path`."""
    from gyre.models.config import ModelConfig
    from gyre.train.config import TrainerConfig
    from gyre.train.trainer import Trainer

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    trainer = Trainer(ModelConfig(name="gpu-check", path=checkpoint), TrainerConfig(bf16=False, lr=1e-4))
    ids = token_ids()
    before = trainer.logprobs(packed(ids, torch.zeros(len(ids)), 1.0)).detach().cpu()
    metrics = trainer.train_step([packed(ids, before, 1.0)])
    after = trainer.logprobs(packed(ids, before, 1.0)).detach().cpu()
    result = dict(before=before, after=after, grad_norm=float(metrics["grad_norm"]))
    torch.save(result | {"weights": trainer.flat.weights.detach().cpu()}, out_path)


def step_on_both_devices(out: dict, checkpoint: str) -> list[bool]:
    """`fp32_step` in a child process on CUDA and in one with CUDA hidden, compared (see the module doc)."""
    results = []
    for device, hide in (("cuda", {}), ("cpu", {"CUDA_VISIBLE_DEVICES": ""})):
        path = os.path.join(checkpoint, f"step_{device}.pt")
        env = os.environ | {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"} | hide
        subprocess.run([sys.executable, __file__, "--step", checkpoint, path], env=env, check=True, timeout=120)
        results.append(torch.load(path))
    gpu, cpu = results
    lp_before = float((gpu["before"] - cpu["before"]).abs().max())
    lp_after = float((gpu["after"] - cpu["after"]).abs().max())
    norm_rel = abs(gpu["grad_norm"] - cpu["grad_norm"]) / cpu["grad_norm"]
    out |= {
        "cpu_step_logprobs_before_max": lp_before,
        "cpu_step_logprobs_after_max": lp_after,
        "cpu_step_grad_norm_rel": norm_rel,
        "cpu_step_weights_max": float((gpu["weights"] - cpu["weights"]).abs().max()),
    }
    return [lp_before <= 1e-3, lp_after <= 1e-3, norm_rel <= 1e-4]


def plan_vs_measured(out: dict, model_cfg, tokens: int, built: int, after_step: int, peak: int) -> list[bool]:
    """The memory plan of this one-GPU trainer (no engine on the GPU, no satellites) against what
    CUDA allocated: `built` after Trainer(), `after_step` after one step, `peak` during it, all
    above the allocation before the trainer was built."""
    from gyre.launch.memory import GpuShape, plan_memory

    plan = plan_memory(
        GpuShape(
            model=model_cfg,
            trainer_tp=1,
            data_parallel=1,
            core_slots=0,
            micro_batch_tokens=tokens,
            engine_tp=1,
            engine_on_gpu=False,
            mem_fraction_static=0.85,
            context_len=tokens,
            capacity_bytes=torch.cuda.get_device_properties(0).total_memory,
        )
    ).trainer
    weights_and_grad = plan["weights"] * 2  # FlatParams and Trainer.grad, both allocated at build
    # what a step adds at its worst: activations, each parameter's .grad and fold's sum, Adam's moments
    step_extra = plan["activations"] + plan["gradients"] - plan["weights"] + plan["optimizer"]
    out |= {
        "plan_weights_and_grad_mb": weights_and_grad >> 20,
        "measured_weights_and_grad_mb": built >> 20,
        "plan_optimizer_mb": plan["optimizer"] >> 20,
        "measured_optimizer_mb": (after_step - built) >> 20,
        "plan_step_peak_mb": step_extra >> 20,
        "measured_step_peak_mb": (peak - built) >> 20,
        "plan_peak_ratio": round((peak - built) / step_extra, 3),
    }
    return [abs(built / weights_and_grad - 1) <= 0.05, abs((after_step - built) / plan["optimizer"] - 1) <= 0.05]


def offload_onload(out: dict, trainer) -> list[bool]:
    """Issue 41 item 3 on CUDA: a satellite's role switch moves the trainer's weights and Adam state
    to pinned host memory and frees its gradient buffer (torch.cuda.memory_allocated falls by about
    their size), then brings them back bit for bit."""
    weights = trainer.flat.weights.clone()
    moved = trainer.flat.weights.numel() * 4 * 4  # fp32 weights, gradient buffer, Adam's two moments
    torch.cuda.synchronize()
    resident, t0 = torch.cuda.memory_allocated(), time.perf_counter()
    trainer.offload()
    torch.cuda.synchronize()
    t1, offloaded = time.perf_counter(), torch.cuda.memory_allocated()
    trainer.onload()
    torch.cuda.synchronize()
    t2, back = time.perf_counter(), torch.cuda.memory_allocated()
    out |= {
        "offload_s": round(t1 - t0, 3),
        "onload_s": round(t2 - t1, 3),
        "offload_freed_mb": (resident - offloaded) >> 20,
        "offload_expected_mb": moved >> 20,
        "onload_back_mb": (back - offloaded) >> 20,
    }
    return [
        resident - offloaded >= 0.95 * moved,
        back - offloaded >= 0.95 * moved,
        torch.equal(weights, trainer.flat.weights),
    ]


def main() -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from gyre.models.checkpoint import load_checkpoint
    from gyre.models.config import ModelConfig
    from gyre.models.transformer import sequence_logprobs
    from gyre.train.config import TrainerConfig
    from gyre.train.trainer import Trainer

    assert torch.cuda.is_available(), "gpu_check needs CUDA"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    t_start, out = time.time(), {}
    d = tempfile.mkdtemp(prefix="gyre-gpu-check-")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**SHAPE, initializer_range=0.05)).to(torch.bfloat16).save_pretrained(d)
    ids = token_ids().cuda()

    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        ref32 = _lp(hf(ids[None]).logits[0, :-1], ids)
        ref16 = _lp(hf.to(torch.bfloat16)(ids[None]).logits[0, :-1], ids)
    del hf
    cfg, weights = load_checkpoint(d)

    def engine_lp(w, dtype):
        with torch.no_grad(), torch.device("cuda"):
            return sequence_logprobs(cfg, {n: t.to("cuda", dtype) for n, t in w.items()}, ids)

    eng32 = engine_lp(weights, torch.float32)
    out["fp32_engine_vs_transformers_max"] = float((eng32 - ref32).abs().max())

    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    trainer = Trainer(ModelConfig(name="gpu-check", path=d), TrainerConfig(bf16=True, lr=1e-4))
    built = torch.cuda.memory_allocated() - base
    n = len(ids)

    def batch(adv: float):
        return packed(ids, torch.cat([torch.zeros(1), eng32.cpu()]), adv)

    def compare(prefix, a, b):
        diff = (a.float().cuda() - b.float().cuda()).abs()
        out[prefix + "_mean"], out[prefix + "_max"] = float(diff.mean()), float(diff.max())
        return float(diff.mean()) <= 0.02 and float(diff.max()) <= 0.5

    tr16 = trainer.logprobs(batch(1.0))[1:]
    eng16 = engine_lp(weights, torch.bfloat16)
    ok = [
        out["fp32_engine_vs_transformers_max"] <= 1e-3,
        compare("bf16_trainer_vs_engine", tr16, eng16),
        compare("bf16_trainer_vs_transformers", tr16, ref16),
        compare("bf16_engine_vs_transformers", eng16, ref16),
    ]
    before = trainer.flat.weights.clone()
    torch.cuda.reset_peak_memory_stats()
    pre_step = torch.cuda.memory_allocated()
    metrics = trainer.train_step([batch(1.0)])
    after = torch.cuda.memory_allocated() - pre_step + built  # less `before` and the log-prob tensors
    peak = torch.cuda.max_memory_allocated() - pre_step + built
    ok += plan_vs_measured(out, trainer.model_cfg, n, built, after, peak)
    out["rl_step_grad_norm"] = float(metrics["grad_norm"])
    out["rl_step_weight_change_max"] = float((trainer.flat.weights - before).abs().max())
    ok += offload_onload(out, trainer)
    ok += step_on_both_devices(out, d)
    pushed = trainer.engine_weights()  # what publish.py sends to engines
    from gyre.engines.core import EngineCore

    core = EngineCore(
        cfg, weights, 0, max_running_requests=1, max_prefill_tokens=8192, page_size=16, prefix_cache_tokens=0
    )
    out["engine_weight_version_after_push"] = core.update_weights(pushed, 1, flush_cache=True)
    ok += [
        out["rl_step_weight_change_max"] > 0,
        compare(
            "after_step_trainer_vs_engine", trainer.logprobs(batch(1.0))[1:], engine_lp(core.weights, torch.bfloat16)
        ),
    ]
    out |= {
        "ok": all(ok),
        "checks_passed": sum(ok),
        "checks": len(ok),
        "wall_s": round(time.time() - t_start, 1),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "peak_gpu_mb": torch.cuda.max_memory_allocated() >> 20,
    }
    print(jsonio.dumps(out))
    torch.distributed.destroy_process_group()
    sys.exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    if sys.argv[1:2] == ["--step"]:
        fp32_step(*sys.argv[2:4])
    else:
        main()
