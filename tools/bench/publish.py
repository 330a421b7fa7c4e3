"""Benchmark: one weight publish per backend, side by side in one run, for the tiny model and a
Qwen3-shaped ~0.5B model (Qwen2.5-0.5B's sizes with Qwen3's q/k norm: 0.49B parameters, fp32;
random weights built from the config, as nothing can be downloaded here).

    PYTHONPATH=. python tools/bench/publish.py [--repeats 3] [--models tiny,qwen3_0_5b]
    PYTHONPATH=. python tools/bench/publish.py --smoke   # the test suite's run: the tiny model, one load each

Each publish is what the core does after a step (gyre.train.publish.WeightPublisher): snapshot the
engine-named weights into a registered buffer (`publish_s`), then the engine loads them
(`load_s`, gyre.engines.weights.load_weights):
- builtin / mooncake: the builtin engine reads the buffer with one Mooncake transfer (TCP here);
- sglang_fake / distributed: the core's sender broadcasts every tensor over gloo while the SGLang
  contract fake receives them through /update_weights_from_distributed (the first load also forms
  the weight group: `first_load_s`).
The snapshot side stands in for CoreServer (same `publish`/`published_tensors` verbs, without a
megatron trainer, which would not fit the box's memory at 0.5B); its copy is the same
`TransferEndpoint.publish_tensors` the core makes. The engines run one after the other, each
`--repeats` loads (medians reported). Prints figures, then one JSON object on the last line.
"""

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gyre.common import jsonio
from gyre.engines.config import EngineConfig
from gyre.engines.launch import BuiltinEngineProcess, SGLangProcess
from gyre.models.config import ModelConfig
from gyre.models.hf import hf_config_of
from gyre.models.transformer import init_weights
from gyre.train.publish import WeightPublisher
from gyre.transfer import BufferLayout, TransferEndpoint

MODELS = {
    "tiny": ModelConfig(name="tiny"),  # conf/model/tiny.yaml
    "qwen3_0_5b": ModelConfig(
        name="qwen3_0_5b",
        num_layers=24,
        hidden_size=896,
        ffn_hidden_size=4864,
        num_attention_heads=14,
        num_query_groups=2,
        head_dim=64,
        qk_norm=True,
        vocab_size=151936,
        max_seq_len=4096,
        rotary_base=1000000.0,
        tie_embeddings=True,
    ),
}


async def _load(engine, weights) -> None:
    """The engine loads `weights` through its process object (EngineHTTPError if it refuses)."""
    async with engine.client(1800) as client:
        await engine.load(client, weights)


class Snapshots:
    """The core's publish verbs over fixed weights: each `publish` copies them into a new registered
    buffer as the next version (CoreServer.publish), the previous one unregistered."""

    def __init__(self, endpoint: TransferEndpoint, weights: dict[str, torch.Tensor]):
        self.endpoint, self.weights, self.version, self._last = endpoint, weights, -1, None

    def publish(self) -> tuple[int, dict]:
        self.version += 1
        descriptor, buffer = self.endpoint.publish_tensors(self.weights)
        if self._last is not None:
            self.endpoint.unregister(self._last[2])
        self._last = (self.version, descriptor, buffer)
        return self.version, descriptor

    def published_tensors(self, version: int) -> dict[str, torch.Tensor]:
        if self._last is None or self._last[0] != version:
            raise KeyError(f"weight version {version} is not published")
        return BufferLayout.from_json(self._last[1]["layout"]).unpack(self._last[2])


def _engine(backend: str, model: ModelConfig, tmp: Path):
    if backend == "builtin":
        return BuiltinEngineProcess(EngineConfig(startup_timeout_s=600, request_timeout_s=1800), model)
    (tmp / model.name).mkdir(exist_ok=True)
    (tmp / model.name / "config.json").write_text(jsonio.dumps(hf_config_of(model)))
    cfg = EngineConfig(
        backend="sglang",
        sglang_fake=True,
        model_path=str(tmp / model.name),
        load_format="dummy",
        enable_hicache=False,
        weight_sync="distributed",
        startup_timeout_s=600,
        request_timeout_s=1800,
    )
    return SGLangProcess(cfg)


def measure(model: ModelConfig, backend: str, sync: str, repeats: int, tmp: Path) -> dict:
    endpoint = TransferEndpoint()
    weights = init_weights(model, 0)
    parameters = sum(t.numel() for t in weights.values())
    snaps = Snapshots(endpoint, weights)
    publisher = WeightPublisher(snaps, sync, model, str(tmp), "127.0.0.1")
    publish_s, load_s = [], []
    try:
        with _engine(backend, model, tmp) as engine:
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                weights = publisher.publish()
                t1 = time.perf_counter()
                asyncio.run(_load(engine, weights))  # as serve_weights has it load (SGLang: paused, in a session)
                publish_s.append(t1 - t0)
                load_s.append(time.perf_counter() - t1)
    finally:
        publisher.close()
        endpoint.close()
    return {
        "parameters": parameters,
        "publish_s": statistics.median(publish_s[1:]),
        "load_s": statistics.median(load_s[1:]),
        "first_load_s": load_s[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--smoke", action="store_true", help="smallest sizes, seconds (the test suite's run)")
    a = p.parse_args()
    if a.smoke:
        a.repeats, a.models = 1, "tiny"
    torch.set_num_threads(1)
    out = {}
    with tempfile.TemporaryDirectory(prefix="gyre-bench-publish-") as tmp:
        for name in a.models.split(","):
            for backend, sync in (("builtin", "mooncake"), ("sglang_fake", "distributed")):
                r = measure(MODELS[name], backend, sync, a.repeats, Path(tmp))
                out[f"{name}/parameters"] = r.pop("parameters")
                for k, v in r.items():
                    out[f"{name}/{backend}_{sync}/{k}"] = round(v, 4)
                    print(f"{name:11s} {backend}/{sync:12s} {k:13s} {v:8.3f} s", flush=True)
            mooncake, gloo = out[f"{name}/builtin_mooncake/load_s"], out[f"{name}/sglang_fake_distributed/load_s"]
            out[f"{name}/gloo_over_mooncake_load"] = round(gloo / mooncake, 2)
    print(jsonio.dumps(out))


if __name__ == "__main__":
    main()
