"""A session's hand-off between two SGLang engines through HiCache's shared L3 store, on the contract
fake (its store a directory standing in for the Mooncake store): the leaving engine wrote the
session's pages through, the receiving engine's first call of the session reads them (its
`cached_tokens`), and the proxy counts them as migrated, none re-prefilled."""

import asyncio
import json

import numpy as np

from gyre.engines.config import EngineConfig
from gyre.engines.launch import SGLangProcess
from gyre.models.checkpoint import save_checkpoint
from gyre.models.transformer import init_weights
from gyre.proxy.config import ProxyConfig
from gyre.proxy.generation import Generation
from gyre.proxy.pool import EnginePool
from tests.integration.test_sglang_behaviour import MODEL, PROMPT

SAMPLING = {"max_new_tokens": 12, "temperature": 1.0}


async def _call(pool: EnginePool, rid: str, ids: list[int]) -> Generation:
    gen = Generation(pool, "s", rid, np.asarray(ids, np.int32), (json.dumps(ids).encode(),), dict(SAMPLING))
    async for _ in gen.stream():
        pass
    return gen


async def _hand_off(a_url: str, b_url: str, records: str) -> tuple[Generation, Generation, EnginePool]:
    pool = EnginePool(ProxyConfig(records_dir=records))
    await pool.register("a", a_url)
    first = await _call(pool, "r-1", PROMPT)
    await pool.register("b", b_url)
    await pool.stop_admission("a")
    await pool.hand_off("a")
    second = await _call(pool, "r-2", PROMPT + first.output_ids + [7, 7, 7])
    await pool.close()
    return first, second, pool


def test_a_hand_off_reads_the_sessions_kv_from_the_shared_store(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_SGLANG_FAKE_L3_DIR", str(tmp_path / "l3"))
    save_checkpoint(tmp_path / "model", MODEL, init_weights(MODEL, 5))
    cfg = EngineConfig(
        backend="sglang",
        sglang_fake=True,
        model_path=str(tmp_path / "model"),
        mooncake_master="127.0.0.1:50051",  # what SGLang would be given; the fake's store is the directory
        page_size=1,  # SGLang's default; /get_model_info does not say it, so the proxy counts tokens
        weight_sync="disk",
        weight_version=0,
        startup_timeout_s=120,
    )
    with SGLangProcess(cfg) as a, SGLangProcess(cfg) as b:
        first, second, pool = asyncio.run(_hand_off(a.url, b.url, str(tmp_path / "records")))
    held = len(PROMPT) + len(first.output_ids) - 1  # the last token's KV was never computed
    assert first.engine_ids == ["a"] and second.engine_ids == ["b"] and first.cached_tokens == 0
    assert second.cached_tokens == held
    assert pool.metrics.kv_migrated_tokens == held > 0 and pool.metrics.kv_reprefill_tokens == 0
