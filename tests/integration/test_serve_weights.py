"""The one way an engine comes to serve a version (gyre.engines.weights.serve_weights), end to end:
SGLang's contract fake behind a real proxy. A harness's call that arrives while the load runs waits
at the proxy, reaches the engine only after the load, and carries the new version (`extra_key`)."""

import asyncio
import json
import time

import aiohttp

from gyre.engines.config import EngineConfig
from gyre.engines.launch import SGLangProcess, attach_engine
from gyre.engines.published import PublishedWeights
from gyre.engines.weights import serve_weights
from gyre.models.checkpoint import save_checkpoint
from gyre.models.transformer import init_weights
from gyre.proxy.admin import ProxyAdmin
from tests.integration.proxy_fixtures import MODEL, new_execution, openai_call, start_proxy


def _audit(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def _until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_a_call_during_a_load_waits_for_it_and_carries_the_new_version(tmp_path, monkeypatch):
    audit = tmp_path / "generate.jsonl"
    monkeypatch.setenv("GYRE_SGLANG_FAKE_AUDIT", str(audit))
    save_checkpoint(tmp_path / "v0", MODEL, init_weights(MODEL, 0))
    save_checkpoint(tmp_path / "v1", MODEL, init_weights(MODEL, 1))
    cfg = EngineConfig(
        backend="sglang",
        sglang_fake=True,
        model_path=str(tmp_path / "v0"),
        enable_hicache=False,
        weight_sync="disk",
        startup_timeout_s=120,
    )
    with SGLangProcess(cfg) as fake:
        proxy = start_proxy(tmp_path, [])
        try:
            key = new_execution(proxy, "ex0")
            asyncio.run(_serve_while_a_call_arrives(proxy, fake.url, cfg, key, audit, tmp_path / "v1"))
        finally:
            proxy.stop()
    audited = _audit(audit)
    (call,) = [a for a in audited if "rid" in a]
    assert call["extra_key"] == call["weight_version"] == "1"
    assert {"exclusive": "update_weights_from_disk", "paused": True} in audited  # SGLang's pause first
    assert {"pause": "retract"} in audited  # engine.pause_mode's default


async def _serve_while_a_call_arrives(proxy, url: str, cfg: EngineConfig, key: str, audit, v1_dir) -> None:
    engine, loading, go = attach_engine(cfg, MODEL, url), asyncio.Event(), asyncio.Event()
    load = engine.load

    async def gated_load(client, weights):
        loading.set()
        await go.wait()
        await load(client, weights)

    engine.load = gated_load
    async with ProxyAdmin(proxy.url, proxy.admin_token) as admin, aiohttp.ClientSession() as session:
        await admin.add_engine("cell0.e0", url, "0")
        serving = asyncio.create_task(
            serve_weights(engine, "cell0.e0", admin, PublishedWeights(1, "disk", {"path": str(v1_dir)}))
        )
        await loading.wait()
        body = {"model": "gyre", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        call = asyncio.create_task(openai_call(session, proxy.url, key, body))

        async def in_flight() -> bool:
            return (await admin.metrics())["executions"].get("ex0", {}).get("num_inflight") == 1

        await _until(in_flight)
        await asyncio.sleep(0.2)  # room for it to reach the engine, were it not held
        assert not _audit(audit) and not call.done()
        go.set()
        await serving
        await call
        assert (await admin.served_versions()) == {"cell0.e0": 1}
