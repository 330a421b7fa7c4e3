"""`python -m gyre.train.hf_check DIR`: parity of Gyre's two forwards with `transformers` on an HF checkpoint.

Loads DIR three ways — `transformers` (the reference), the builtin engine's loader and the megatron
trainer (TP 1) — runs each on the same random ids in fp32, then writes the trainer's weights back
as an HF directory in DIR's dtype and compares them with DIR's tensors bit for bit. Prints one JSON
line: `trainer_max_abs_diff`, `engine_max_abs_diff` (log-probs; the engine's over its full forward
and its KV-cached chunked prefill + decode path), `roundtrip_bitwise`, and per stage (load + forward; the trainer's
also the write-back) wall and CPU seconds and peak RSS. Models are freed between stages.
"""

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from gyre.common import jsonio
from gyre.models.config import ModelConfig


def _peak_rss_mb() -> float:
    line = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
    return round(int(line.split()[1]) / 1024, 1)


def _reset_peak_rss() -> None:
    """Start a new peak-RSS window (Linux: writing 5 to clear_refs resets VmHWM to the current RSS)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _gather(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)


def transformers_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return _gather(model(torch.tensor([ids])).logits[0, :-1], ids[1:])


def engine_logprobs(path: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(full-forward log-probs, KV-cached log-probs of the second half: one prefill chunk, then decodes)."""
    from gyre.engines.runner import SeqKV, StepItem, run_step
    from gyre.models.checkpoint import load_checkpoint
    from gyre.models.transformer import sequence_logprobs

    cfg, weights = load_checkpoint(path)
    with torch.no_grad():
        full = sequence_logprobs(cfg, weights, ids)
        kv, half, cached = SeqKV(cfg, capacity=len(ids)), len(ids) // 2, []
        feed = [ids[:half]] + [[t] for t in ids[half:-1]]
        for chunk in feed:
            item = StepItem(kv, chunk, want_logits=True)
            run_step(cfg, weights, [item])
            cached.append(item.logits)
    return full, _gather(torch.stack(cached), ids[half:])


def trainer_check(path: str, ids: list[int]) -> tuple[torch.Tensor, bool]:
    """(trainer log-probs, whether its weights written back as HF equal DIR's bit for bit)."""
    from gyre.models.hf import source_dtype, write_hf_dir
    from gyre.train.config import TrainerConfig
    from gyre.train.trainer import Trainer
    from gyre.trajectory.sample import PackedBatch

    trainer = Trainer(ModelConfig(name="hf-check", path=path), TrainerConfig())
    n = len(ids)
    batch = PackedBatch(
        tokens=torch.tensor(ids),
        position_ids=torch.arange(n),
        cu_seqlens=torch.tensor([0, n], dtype=torch.int32),
        target_mask=torch.arange(n) > 0,
        behaviour_logprobs=torch.zeros(n),
        loss_weights=(torch.arange(n) > 0).float(),
        advantages=torch.zeros(n),
        weight_versions=torch.zeros(n, dtype=torch.int64),
        execution_ids=("hf-check",),
    )
    with torch.no_grad():
        lp = trainer.logprobs(batch)[1:]
    with tempfile.TemporaryDirectory() as out:
        write_hf_dir(out, trainer.model_cfg, trainer.engine_weights(), dtype=source_dtype(path), source=path)
        del trainer
        gc.collect()
        src = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            src |= load_file(str(f))
        back = load_file(os.path.join(out, "model.safetensors"))
    tied = ModelConfig(path=path).tie_embeddings
    src = {
        k: v for k, v in src.items() if not k.endswith("rotary_emb.inv_freq") and not (tied and k == "lm_head.weight")
    }
    same = src.keys() == back.keys() and all(
        src[k].dtype == back[k].dtype and torch.equal(src[k], back[k]) for k in src
    )
    return lp, same


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a Hugging Face checkpoint directory")
    p.add_argument("--tokens", type=int, default=64, help="length of the random id sequence")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = ModelConfig(name="hf-check", path=a.path)  # refuses unsupported architectures, naming the field
    ids = torch.randint(0, cfg.vocab_size, (a.tokens,), generator=torch.Generator().manual_seed(a.seed)).tolist()
    stages, results = {}, {}
    for name, run in (("transformers", transformers_logprobs), ("engine", engine_logprobs), ("trainer", trainer_check)):
        gc.collect()
        _reset_peak_rss()
        t0, cpu0 = time.perf_counter(), time.process_time()
        results[name] = run(a.path, ids)
        stages[name] = {
            "wall_s": round(time.perf_counter() - t0, 2),
            "cpu_s": round(time.process_time() - cpu0, 2),
            "peak_rss_mb": _peak_rss_mb(),
        }
    ref = results["transformers"]
    full, cached = results["engine"]
    trainer_lp, bitwise = results["trainer"]
    half = len(ids) // 2
    print(
        jsonio.dumps(
            {
                "trainer_max_abs_diff": float((trainer_lp - ref).abs().max()),
                "engine_max_abs_diff": float(max((full - ref).abs().max(), (cached - ref[half - 1 :]).abs().max())),
                "roundtrip_bitwise": bitwise,
                "tokens": len(ids),
                "num_layers": cfg.num_layers,
                "hidden_size": cfg.hidden_size,
                "stages": stages,
            }
        )
    )


if __name__ == "__main__":
    main()
