"""A hand-off moves every session of the leaving engine with its KV (over Mooncake, builtin engines
with a scripted policy): idle sessions and calls in flight, while other calls stream; the drain
answers only once every move has ended, so the cell may release the engine's memory right after;
a full target is a counted re-prefill, never an error; a returning engine takes sessions."""

import asyncio
import json
import random

import aiohttp
import pytest
from proxy_fixtures import http, new_execution, openai_call, start_engine, start_proxy

from gyre.engines.client import EngineClient
from gyre.records.io import read_records

LONG_OUT = "Still working on it, one careful step after another. " * 24
RULES = [{"match": "LONGOUT", "emit": LONG_OUT}, {"match": "SHORT", "emit": "ok"}]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engines")
    procs = []
    try:  # the third has room for 512 tokens of moved KV only
        for name, extra in (("e0", {}), ("e1", {}), ("small", {"prefix_cache_tokens": 512})):
            procs.append(start_engine(tmp, RULES, name=name, max_prefill_tokens=1024, **extra))
        yield procs
    finally:
        for p in procs:
            p.stop()


def _context(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(n))


def _body(text: str, stream: bool = False) -> dict:
    return {"model": "gyre", "stream": stream, "max_tokens": 2000, "messages": [{"role": "user", "content": text}]}


async def _turn(s, proxy, key: str, body: dict, then: str) -> dict:
    """One call, then the conversation extended with its answer and a new user message."""
    choice = await openai_call(s, proxy.url, key, body)
    return {**body, "messages": body["messages"] + [choice["message"], {"role": "user", "content": then}]}


async def _stream(s, proxy, key: str, body: dict, first: asyncio.Event) -> str:
    """A streamed chat completion's content; sets `first` once output arrives (its prefill is done)."""
    headers = {"Authorization": f"Bearer {key}"}
    async with s.post(proxy.url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers) as r:
        assert r.status == 200, await r.text()
        text = ""
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                text += "".join(c["delta"].get("content") or "" for c in json.loads(line[5:])["choices"])
                if text:
                    first.set()
        return text


def _op(proxy, eid: str, op: str) -> dict:
    status, out = http(f"{proxy.url}/admin/engines/{eid}/{op}", "POST", token=proxy.admin_token)
    assert status == 200, out
    return out


def _metrics(proxy) -> dict:
    return http(proxy.url + "/admin/metrics", token=proxy.admin_token)[1]


def _last(tmp_path, name: str):
    return read_records(tmp_path / "records" / f"{name}.jsonl")[0][-1]


def test_hand_off_moves_idle_and_streaming_sessions_with_their_kv_before_memory_is_released(engines, tmp_path):
    e0, e1, _ = engines
    proxy = start_proxy(tmp_path, [e0.url, e1.url])
    try:
        keys = {n: new_execution(proxy, n) for n in ("idle", "moving", "other")}

        async def main():
            async with aiohttp.ClientSession() as s:
                _op(proxy, "e1", "stop_admission")  # idle and moving start on e0
                idle = await _turn(s, proxy, keys["idle"], _body("SHORT " + _context(1, 3000)), "SHORT next")
                decoding = asyncio.Event()
                moving = asyncio.create_task(
                    _stream(s, proxy, keys["moving"], _body("LONGOUT " + _context(2, 3000)), decoding)
                )
                await decoding.wait()  # its whole prompt's KV is on e0
                _op(proxy, "e1", "activate")
                _op(proxy, "e0", "stop_admission")  # other streams from e1 during the hand-off
                streaming = asyncio.Event()
                other = asyncio.create_task(
                    _stream(s, proxy, keys["other"], _body("LONGOUT " + _context(3, 500)), streaming)
                )
                await streaming.wait()
                out = await asyncio.to_thread(_op, proxy, "e0", "drain")
                async with EngineClient(e0.url) as c:  # what the cell does next (gyre.cells.leader)
                    await c.release_memory()
                    try:
                        outs = await asyncio.gather(moving, other)
                        again = await openai_call(s, proxy.url, keys["idle"], idle)
                    finally:
                        await c.resume_memory()
                _op(proxy, "e0", "activate")
                return out, outs, again

        out, (moving, other), again = asyncio.run(main())
        assert out["result"] == {"num_aborted": 1, "num_sessions": 2}
        assert moving.strip() == other.strip() == LONG_OUT.strip()
        assert again["message"]["content"] == "ok"
        first_idle, next_idle = read_records(tmp_path / "records" / "idle.jsonl")[0]
        context = first_idle.num_tokens - 1  # the last output token has no KV yet
        assert next_idle.engine_id == "e1" and next_idle.hints["cached_tokens"] >= context // 16 * 16
        rec = _last(tmp_path, "moving")
        assert rec.rerouted and rec.engine_id == "e1" and rec.num_migrated_tokens >= 3000
        assert not _last(tmp_path, "other").rerouted
        m = _metrics(proxy)
        assert m["kv_reprefill_tokens"] == 0 and m["num_sessions_moved"] == 1
        assert m["kv_migrated_tokens"] >= context // 16 * 16 + 3000
    finally:
        proxy.stop()


def test_a_full_target_is_a_counted_reprefill_and_a_returning_engine_takes_sessions(engines, tmp_path):
    e0, _, small = engines
    proxy = start_proxy(tmp_path, [e0.url, small.url], rebalance_on_return=True)
    try:
        keys = {n: new_execution(proxy, n) for n in ("big", "s1", "s2", "s3")}

        async def main():
            async with aiohttp.ClientSession() as s:
                _op(proxy, "e1", "stop_admission")
                bodies = {
                    n: await _turn(s, proxy, keys[n], _body(f"SHORT {n} " + _context(4, 200)), "SHORT")
                    for n in ("s1", "s2", "s3")
                }
                big = await _turn(s, proxy, keys["big"], _body("SHORT " + _context(5, 2000)), "SHORT more")
                back = _op(proxy, "e1", "activate")  # 4 sessions on e0, none on e1: two move
                calls = {n: await openai_call(s, proxy.url, keys[n], b) for n, b in bodies.items()}
                drained = await asyncio.to_thread(_op, proxy, "e0", "drain")  # big's 2000 tokens cannot fit
                after = await openai_call(s, proxy.url, keys["big"], big)
                _op(proxy, "e0", "activate")
                return back, calls, drained, after

        back, calls, drained, after = asyncio.run(main())
        assert back["result"] == {"num_sessions": 2}
        moved = [n for n in ("s1", "s2", "s3") if _last(tmp_path, n).engine_id == "e1"]
        for n in moved:  # found their KV on the returning engine
            assert _last(tmp_path, n).hints["cached_tokens"] >= 200
        assert after["message"]["content"] == "ok" and _last(tmp_path, "big").hints["cached_tokens"] < 512
        m = _metrics(proxy)
        assert m["kv_reprefill_tokens"] >= 2000 and drained["result"]["num_sessions"] >= 2
    finally:
        proxy.stop()
