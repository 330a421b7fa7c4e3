"""Shared helpers for engine tests: start servers, run async client code from sync tests."""

import asyncio
import os

import pytest

from gyre.engines.client import EngineClient
from gyre.engines.config import EngineConfig
from gyre.engines.launch import BuiltinEngineProcess, SGLangProcess
from gyre.models.config import ModelConfig

MODEL = ModelConfig()  # tiny
SEED = 0


def run(coro_fn, url: str):
    """Run `coro_fn(client)` against `url` to completion (tests stay sync; no pytest-asyncio)."""

    async def main():
        async with EngineClient(url, timeout_s=120) as c:
            return await coro_fn(c)

    return asyncio.run(main())


def start_builtin(**overrides) -> BuiltinEngineProcess:
    cfg = EngineConfig(init_seed=SEED, startup_timeout_s=120, **overrides)
    proc = BuiltinEngineProcess(cfg, MODEL)
    proc.start()
    return proc


def start_sglang_fake(model_dir) -> SGLangProcess:
    """SGLang's contract fake (gyre.engines.sglang_fake) serving MODEL's HF directory, started as SGLang would be."""
    from gyre.models.checkpoint import save_checkpoint
    from gyre.models.transformer import init_weights

    save_checkpoint(model_dir, MODEL, init_weights(MODEL, SEED))
    cfg = EngineConfig(
        backend="sglang",
        sglang_fake=True,
        model_path=str(model_dir),
        enable_hicache=False,
        weight_sync="distributed",
        startup_timeout_s=120,
    )
    proc = SGLangProcess(cfg)
    proc.start()
    return proc


def start_sglang(**overrides) -> SGLangProcess:
    """A real SGLang server with random (dummy) weights; needs a GPU, sglang, and a model dir's config."""
    pytest.importorskip("sglang")
    model = os.environ.get("GYRE_SGLANG_MODEL")
    if not model:
        pytest.skip("set GYRE_SGLANG_MODEL to a model directory (config + tokenizer) to test SGLang")
    cfg = EngineConfig(
        **{
            "backend": "sglang",
            "model_path": model,
            "load_format": "dummy",
            "enable_hicache": False,
            "mem_fraction_static": 0.3,
            "startup_timeout_s": 900,
            "weight_sync": "distributed",
        }
        | overrides
    )
    proc = SGLangProcess(cfg)
    proc.start()
    return proc
