"""Benchmark: a hand-off of S sessions of L tokens from one builtin engine to another, with their KV.

Two builtin engines A and B (tiny model, scripted policy) behind one proxy. Each session's context
(L tokens) is on A: its KV is planted on A over Mooncake (random values: a 16K-token prefill per
session would take minutes on CPU; moving and serving KV costs the same whatever its values), then
one call through the proxy pins the session to A and tells the proxy its context. Each engine's
transfer arena (engine.kv_arena_mib: memory touched at start, registered with Mooncake once, its
endpoint opened at start, that the prefix cache keeps its pages in and imports read into) holds
twice the sessions' KV, as an engine's KV memory is sized for what it serves. Half the sessions
then start a long call (in flight), and A is switched to training the way a cell does it:
stop_admission, drain (one batched move A -> B of every idle session's KV and the in-flight calls'
prompts beside their abort; answers once every session's KV has moved or been given up), release
A's memory. Figures, side by side in one run:

  kv_bytes               bytes of KV the hand-off moved or gave up (tokens x bytes per token)
  kv_migrated_tokens     tokens whose KV moved (proxy counter); kv_reprefill_tokens: did not
  handoff_s              the drain call's wall time (abort, reassign, every KV move)
  transfer_floor_s       raw Mooncake reads of the same bytes (S x L tokens of KV) in S pieces, one
                         after the other, between two endpoints of this process (no copies, no
                         HTTP): the mean of transfer_floor_s_before and _after, measured just before
                         and just after the hand-off, so a load that changes meanwhile shows as
                         a spread between them
  handoff_cpu_s          CPU-seconds engines A and B and the proxy used during the drain call (also
                         per process: handoff_cpu_s_by_process), and transfer_floor_cpu_s the
                         floor's (this process: both endpoints of its reads): on a loaded box these
                         move less than wall times do. Mooncake's synchronous reads spin their
                         calling thread until they end, in both: a read that waits for a core
                         (the source's decode step and aborts beside it, on 2 cores) costs more
  first_call_s_migrated  median latency of an idle session's first call after the hand-off (on B,
                         its KV moved), once the resumed calls are done
  first_call_s_reprefill the same through a second proxy with migrate_kv=false (B recomputes the
                         context); only for L <= --reprefill-max-tokens (a 128K prefill takes minutes)

Targets (issues 28, 45): kv_reprefill_tokens == 0; handoff_s <= 2 x transfer_floor_s + 0.5;
handoff_cpu_s <= 1.5 x transfer_floor_cpu_s; at 16K first_call_s_reprefill / first_call_s_migrated >= 5.

Usage: PYTHONPATH=. python tools/bench/handoff.py [--configs 16x16384,4x131072] [--reprefill-max-tokens 16384]
       [--smoke]   (the test suite's run: every step above for 2 sessions of 256 tokens, seconds)
Last line: one JSON object: the first config's figures at top level, every config under "runs".
"""

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time

import aiohttp
import psutil
import torch

from gyre.common import jsonio
from gyre.engines.client import EngineClient
from gyre.engines.config import EngineConfig
from gyre.engines.kv_transfer import describe_session
from gyre.engines.launch import BuiltinEngineProcess
from gyre.models.config import ModelConfig
from gyre.models.tokenizer import ByteTokenizer
from gyre.proxy.config import ProxyConfig
from gyre.proxy.main import ProxyProcess
from gyre.records.io import read_records
from gyre.transfer import TransferEndpoint

LONG_OUT = "Reading the next file and thinking about the change. " * 6
RULES = [{"match": "LONGOUT", "emit": LONG_OUT}, {"match": "SHORT", "emit": "ok"}]
PAGE = 16


def _model(tokens: int) -> ModelConfig:
    return ModelConfig(max_seq_len=tokens + 4096)  # conf/model/tiny.yaml's shape: 2 layers, 2 KV heads of 32


def _kv_shape(m: ModelConfig, tokens: int) -> tuple[int, ...]:
    """The builtin engine's KV of `tokens` tokens: [layers, K/V, tokens, KV heads, head dim] (float32)."""
    return (m.num_layers, 2, tokens, m.num_query_groups, m.head_dim or m.hidden_size // m.num_attention_heads)


def _text(seed: int, tokens: int) -> str:
    rng = random.Random(seed)
    return "SHORT " + "".join(rng.choice("abcdefghij klmnopqrstuvwxyz.") for _ in range(tokens - 40))


def _body(messages: list[dict], max_tokens: int = 4, stream: bool = False) -> dict:
    return {"model": "gyre", "max_tokens": max_tokens, "stream": stream, "messages": messages}


class Bench:
    """Two engines and what the bench does to them (proxies come and go per measurement)."""

    def __init__(self, sessions: int, tokens: int, tmp: str):
        self.sessions, self.tokens, self.tmp = sessions, tokens, tmp
        self.model = _model(tokens)
        policy = os.path.join(tmp, "policy.json")
        with open(policy, "w") as f:
            f.write(jsonio.dumps({"rules": RULES}))
        kv_mib = sessions * (tokens + 4096) * torch.Size(_kv_shape(self.model, 1)).numel() * 4 / 2**20
        cfg = EngineConfig(
            init_seed=0,
            scripted_policy=policy,
            prefix_cache_tokens=(sessions + 2) * (tokens + 4096),
            kv_arena_mib=int(2 * kv_mib) + 1,  # the planted (or moved) KV, and room beside it
            max_running_requests=sessions + 4,
            startup_timeout_s=300,
        )
        self.engines = [BuiltinEngineProcess(cfg, self.model) for _ in range(2)]
        self.endpoint = TransferEndpoint()
        self.tok = ByteTokenizer(self.model.vocab_size)

    def start(self) -> None:
        for e in self.engines:
            e.start()

    def stop(self) -> None:
        for e in self.engines:
            e.stop()
        self.endpoint.close()

    def proxy(self, name: str, migrate_kv: bool) -> ProxyProcess:
        return ProxyProcess(
            ProxyConfig(
                records_dir=os.path.join(self.tmp, name),
                engines=[e.url for e in self.engines],
                model_names=["gyre"],
                max_imbalance=10**6,  # in-flight calls stay on A until the hand-off
                migrate_kv=migrate_kv,
                fsync=False,
                context_len=self.model.max_seq_len,
            )
        ).start()

    async def plant(self, c: EngineClient, messages: list[dict], seed: int) -> None:
        """Put random KV for the rendered prompt's full pages into engine A's prefix cache (an
        import of an export this process makes)."""
        ids = self.tok.apply_chat_template(messages)
        n = (len(ids) - 1) // PAGE * PAGE
        kv = torch.randn(_kv_shape(self.model, n), generator=torch.Generator().manual_seed(seed))
        id_buf = torch.tensor(ids[:n], dtype=torch.int32)
        for t in (kv, id_buf):
            self.endpoint.register(t)
        export = {
            "session_id": self.endpoint.session_id,
            "page_shape": [*kv.shape[:2], *kv.shape[3:]],
            "sessions": [describe_session(id_buf, [kv], 0)],
            "weight_version": 0,
        }
        try:
            out = await c.import_kv(export)
            assert out["sessions"][0]["refused"] is None, out
        finally:
            for t in (kv, id_buf):
                self.endpoint.unregister(t)

    def floor_s(self, total_bytes: int) -> tuple[float, float]:
        """Raw Mooncake reads of `total_bytes` in `sessions` pieces, one after the other: (wall
        seconds, CPU-seconds)."""
        piece = -(-total_bytes // self.sessions)
        reader = TransferEndpoint()
        src, dst = torch.ones(piece, dtype=torch.uint8), torch.empty(piece, dtype=torch.uint8)
        addr = self.endpoint.register(src)
        reader.register(dst)
        try:
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(self.sessions):
                reader.read(self.endpoint.session_id, addr, dst)
            return time.perf_counter() - t0, time.process_time() - c0
        finally:
            reader.close()
            self.endpoint.unregister(src)


def _cpu_s(pids: list[int]) -> list[float]:
    return [sum(psutil.Process(p).cpu_times()[:2]) for p in pids]


async def _admin(s: aiohttp.ClientSession, proxy: ProxyProcess, method: str, path: str, body=None) -> dict:
    headers = {"Authorization": f"Bearer {proxy.admin_token}"}
    async with s.request(method, proxy.url + path, json=body, headers=headers) as r:
        out = await r.json()
        assert r.status == 200, out
        return out


async def _call(s: aiohttp.ClientSession, proxy: ProxyProcess, key: str, body: dict) -> tuple[str, float]:
    """One chat completion (a stream read to its end); returns (content, seconds)."""
    t0 = time.perf_counter()
    async with s.post(proxy.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        text = await r.text()
        assert r.status == 200, text
    if body["stream"]:
        parts = [jsonio.loads(x[5:]) for x in text.splitlines() if x.startswith("data:") and "[DONE]" not in x]
        return "".join(c["delta"].get("content") or "" for p in parts for c in p["choices"]), time.perf_counter() - t0
    return jsonio.loads(text)["choices"][0]["message"]["content"], time.perf_counter() - t0


async def _pinned_sessions(b: Bench, s, proxy, names: list[str], seed: int) -> dict[str, tuple[str, list[dict]]]:
    """Sessions whose context is on A (KV planted, one call made); B takes no new sessions meanwhile."""
    await _admin(s, proxy, "POST", "/admin/engines/e1/stop_admission")
    out = {}
    async with EngineClient(b.engines[0].url, timeout_s=600) as a:
        for i, name in enumerate(names):
            key = (await _admin(s, proxy, "POST", "/admin/executions", {"execution_id": name}))["api_key"]
            messages = [{"role": "user", "content": _text(seed + i, b.tokens)}]
            await b.plant(a, messages, seed + i)
            content, _ = await _call(s, proxy, key, _body(messages))
            out[name] = (key, messages + [{"role": "assistant", "content": content}])
    await _admin(s, proxy, "POST", "/admin/engines/e1/activate")
    return out


async def _first_calls(s, proxy, sessions: dict) -> list[float]:
    """Each session's next call, one after the other: their latencies."""
    times = []
    for key, messages in sessions.values():
        _, dt = await _call(s, proxy, key, _body(messages + [{"role": "user", "content": "SHORT again"}]))
        times.append(dt)
    return times


async def migrated(b: Bench) -> dict:
    proxy = b.proxy("migrated", True)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
            names = [f"s{i}" for i in range(b.sessions)]
            pinned = await _pinned_sessions(b, s, proxy, names, 0)
            busy, idle = names[: b.sessions // 2], names[b.sessions // 2 :]
            ask = {"role": "user", "content": "LONGOUT go on"}
            flying = [
                asyncio.create_task(_call(s, proxy, pinned[n][0], _body(pinned[n][1] + [ask], 4000, True)))
                for n in busy
            ]
            while (await _admin(s, proxy, "GET", "/admin/metrics"))["engines"][0]["num_inflight"] < len(busy):
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # they are decoding
            await _admin(s, proxy, "POST", "/admin/engines/e0/stop_admission")
            pids = [e.proc.pid for e in b.engines] + [proxy.proc.pid]
            t0, c0 = time.perf_counter(), _cpu_s(pids)
            drained = await _admin(s, proxy, "POST", "/admin/engines/e0/drain")
            handoff_s, cpu = time.perf_counter() - t0, [c - c0 for c, c0 in zip(_cpu_s(pids), c0)]
            async with EngineClient(b.engines[0].url) as a:
                await a.release_memory()  # refused (400) if a call still ran on A
                outs = await asyncio.gather(*flying)
                assert all(o == LONG_OUT.strip() for o, _ in outs), "a resumed call lost or changed tokens"
                first = await _first_calls(s, proxy, {n: pinned[n] for n in idle})
                await a.resume_memory()
            m = await _admin(s, proxy, "GET", "/admin/metrics")
    finally:
        proxy.stop()
    cached = [read_records(os.path.join(b.tmp, "migrated", f"{n}.jsonl"))[0][-1].hints["cached_tokens"] for n in idle]
    return {
        "num_aborted": drained["result"]["num_aborted"],
        "handoff_s": handoff_s,
        "handoff_cpu_s": sum(cpu),
        "handoff_cpu_s_by_process": dict(zip(("A", "B", "proxy"), cpu)),
        "kv_migrated_tokens": m["kv_migrated_tokens"],
        "kv_reprefill_tokens": m["kv_reprefill_tokens"],
        "first_call_s_migrated": statistics.median(first),
        "first_call_min_cached_tokens": min(cached),
    }


async def reprefill(b: Bench, num: int = 2) -> tuple[float, int]:
    """Median first-call latency after a hand-off with migration off (B recomputes each context),
    and the most prompt tokens B found cached for one of them."""
    proxy = b.proxy("reprefill", False)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
            pinned = await _pinned_sessions(b, s, proxy, [f"r{i}" for i in range(num)], 1000)
            await _admin(s, proxy, "POST", "/admin/engines/e0/drain")
            first = await _first_calls(s, proxy, pinned)
    finally:
        proxy.stop()
    records = [read_records(os.path.join(b.tmp, "reprefill", f"{n}.jsonl"))[0][-1] for n in pinned]
    return statistics.median(first), max(r.hints["cached_tokens"] for r in records)


def run(sessions: int, tokens: int, reprefill_max: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="gyre-handoff-") as tmp:
        b = Bench(sessions, tokens, tmp)
        try:
            b.start()
            token_bytes = torch.Size(_kv_shape(b.model, 1)).numel() * 4
            before = b.floor_s(sessions * tokens * token_bytes)
            out = {"sessions": sessions, "tokens": tokens, **asyncio.run(migrated(b))}
            after = b.floor_s(sessions * tokens * token_bytes)
            out["kv_bytes"] = (out["kv_migrated_tokens"] + out["kv_reprefill_tokens"]) * token_bytes
            out["transfer_floor_s_before"], out["transfer_floor_s_after"] = before[0], after[0]
            out["transfer_floor_s"] = (before[0] + after[0]) / 2
            out["transfer_floor_cpu_s"] = (before[1] + after[1]) / 2
            out["first_call_s_reprefill"] = out["first_call_max_cached_tokens_reprefill"] = None
            if tokens <= reprefill_max:
                out["first_call_s_reprefill"], out["first_call_max_cached_tokens_reprefill"] = asyncio.run(reprefill(b))
        finally:
            b.stop()
    out["targets"] = {
        "no_reprefill": out["kv_reprefill_tokens"] == 0,
        "handoff_within_2x_floor_plus_0.5s": out["handoff_s"] <= 2 * out["transfer_floor_s"] + 0.5,
        "handoff_cpu_within_1.5x_floor": out["handoff_cpu_s"] <= 1.5 * out["transfer_floor_cpu_s"],
        "first_call_5x_faster": None
        if out["first_call_s_reprefill"] is None
        else out["first_call_s_reprefill"] >= 5 * out["first_call_s_migrated"],
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="16x16384,4x131072", help="SESSIONSxTOKENS, comma-separated")
    p.add_argument("--reprefill-max-tokens", type=int, default=16384)
    p.add_argument("--smoke", action="store_true", help="smallest sizes, seconds (the test suite's run)")
    a = p.parse_args()
    if a.smoke:
        a.configs, a.reprefill_max_tokens = "2x256", 256
    runs = []
    for spec in a.configs.split(","):
        s, n = (int(x) for x in spec.split("x"))
        r = run(s, n, a.reprefill_max_tokens)
        runs.append(r)
        re = r["first_call_s_reprefill"]
        by_process = ", ".join(f"{k} {v:.2f}" for k, v in r["handoff_cpu_s_by_process"].items())
        print(
            f"{s} x {n} tokens: kv {r['kv_bytes'] / 2**20:.0f} MiB, migrated {r['kv_migrated_tokens']} tokens, "
            f"re-prefill {r['kv_reprefill_tokens']}; hand-off {r['handoff_s']:.3f} s (raw Mooncake "
            f"{r['transfer_floor_s_before']:.3f} s before, {r['transfer_floor_s_after']:.3f} s after); "
            f"CPU-s: hand-off {r['handoff_cpu_s']:.2f} ({by_process}), "
            f"raw Mooncake {r['transfer_floor_cpu_s']:.2f}; "
            f"first call after: {r['first_call_s_migrated']:.3f} s migrated, "
            f"{re if re is None else round(re, 3)} s re-prefilled; targets {r['targets']}; "
            f"load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    print(jsonio.dumps({**{k: v for k, v in runs[0].items()}, "runs": runs}))


if __name__ == "__main__":
    main()
