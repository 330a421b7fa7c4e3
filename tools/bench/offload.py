"""Benchmark: a cell's trainer state off the device and back (the offload_trainer / onload_trainer
role-switch phases), for the tiny model (a real megatron-core Trainer that has stepped, so it holds
Adam state) and a Qwen3-shaped ~0.5B model (the storages `Trainer.offload` moves, by size: fp32
weights and Adam's two moments; its gradient buffer is freed, not moved; a megatron trainer of that
size would not fit this box beside the rest), through the very functions the Trainer uses
(gyre.train.trainer.move_to_host / move_back).

    PYTHONPATH=. python tools/bench/offload.py [--repeats 3] [--models tiny,qwen3_0_5b] [--smoke]

On CPU both sides are host memory, so the figures are copy costs (memory bandwidth): the lower
bound of what a GPU's device-to-host copy over PCIe adds. CPU seconds from /proc (this process).
`--smoke`: the tiny model once (seconds). Prints figures, then one JSON object on the last line.
"""

import argparse
import math
import resource
import statistics
import time

import torch
from publish import MODELS  # this folder's (tools/bench) publish benchmark

from gyre.common import jsonio
from gyre.models.config import ModelConfig
from gyre.models.transformer import param_shapes
from gyre.train.trainer import move_back, move_to_host

QWEN3_0_5B = MODELS["qwen3_0_5b"]  # publish.py's shape: Qwen2.5-0.5B's sizes with Qwen3's q/k norm


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _tiny_storages() -> tuple[list[torch.UntypedStorage], int]:
    """A real tiny Trainer after one step: the storages its `offload` moves, and its parameter count."""
    from gyre.train.config import TrainerConfig
    from gyre.train.trainer import Trainer
    from tests.unit._train_ref import random_batches  # a test helper: random packed batches

    model = ModelConfig(name="tiny")
    trainer = Trainer(model, TrainerConfig(), seed=0)
    trainer.train_step(random_batches(model, 1, 2, seed=0))
    return trainer._resident(), trainer.flat.weights.numel()


def _sized_storages(cfg: ModelConfig) -> tuple[list[torch.UntypedStorage], int]:
    """Weights and Adam's two moments of `cfg`'s size, fp32 (what a core rank of one holds)."""
    n = sum(math.prod(shape) for shape in param_shapes(cfg).values())
    return [torch.ones(n, dtype=torch.float32).untyped_storage() for _ in range(3)], n


def measure(storages: list[torch.UntypedStorage], repeats: int) -> dict:
    off, on, cpu = [], [], []
    for _ in range(repeats):
        c0, t0 = _cpu_s(), time.perf_counter()
        host = move_to_host(storages, pin=False)
        t1 = time.perf_counter()
        move_back(host)
        t2 = time.perf_counter()
        off.append(t1 - t0)
        on.append(t2 - t1)
        cpu.append(_cpu_s() - c0)
    nbytes = sum(s.nbytes() for s in storages)
    return {
        "bytes": nbytes,
        "offload_s": round(statistics.median(off), 4),
        "onload_s": round(statistics.median(on), 4),
        "cpu_s": round(statistics.median(cpu), 4),
        "gb_per_s": round(2 * nbytes / 1e9 / max(statistics.median(off) + statistics.median(on), 1e-9), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", default="tiny,qwen3_0_5b")
    p.add_argument("--smoke", action="store_true", help="the tiny model once")
    a = p.parse_args()
    models, repeats = (["tiny"], 1) if a.smoke else (a.models.split(","), a.repeats)
    torch.set_num_threads(1)
    out = {}
    for name in models:
        storages, params = _tiny_storages() if name == "tiny" else _sized_storages(QWEN3_0_5B)
        out[name] = {"params": params} | measure(storages, repeats)
        r = out[name]
        print(
            f"{name}: {params / 1e6:.1f}M params, {r['bytes'] / 1e9:.2f} GB: offload {r['offload_s']} s, "
            f"onload {r['onload_s']} s ({r['gb_per_s']} GB/s), {r['cpu_s']} CPU-s"
        )
    print(jsonio.dumps(out))


if __name__ == "__main__":
    main()
