"""Proxy benchmark: latency the proxy adds over calling the engine directly, and records written.

One builtin engine (tiny model, random policy, 4 new tokens per call) serves N concurrent sessions
that each make 2M calls of the same ~300-token conversation, alternating (a) straight to the
engine's /generate with the prompt ids the proxy would render, and (b) through the proxy's
Anthropic API (auth, parsing, token-faithful rendering, routing, the engine call, parsing the
output, one fsync'd record per call), so both paths see the same engine load and CPU contention.
Added latency = percentile(proxy) - percentile(direct) of per-call wall times. On a small shared
CPU box the engine, the proxy and this client compete for cores: `proxy_cpu_ms_per_call` (the
proxy process's CPU time per call) is the cost that transfers to a GPU deployment.

Prints a table, then ONE JSON object on the last line:
  added_ms_p50, added_ms_p99    proxy minus direct, per-call latency percentiles
  direct_ms_p50/p99, proxy_ms_p50/p99
  paired_added_ms_p50/p99       per call, the client's wait minus the engine call the proxy made for
                                it (both paths have one engine round trip): engine-load noise cancels
  in_proxy_ms_p50/p99           per call, time in the proxy outside engine calls (parse, render,
                                routing, queueing on its event loop, output parsing), from records
  records_per_s                 records appended (fsync each) per second of the measured rounds
  proxy_cpu_ms_per_call         CPU time of the proxy process per proxied call
  num_sessions, calls_per_session, rounds

Usage: PYTHONPATH=. python tools/bench/proxy.py [--sessions 64] [--calls 10] [--rounds 2] [--think-ms 0]
"""

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import psutil

from gyre.engines.client import EngineClient
from gyre.engines.config import EngineConfig
from gyre.engines.launch import BuiltinEngineProcess
from gyre.models.config import ModelConfig
from gyre.models.tokenizer import ByteTokenizer
from gyre.proxy.config import ProxyConfig
from gyre.proxy.main import ProxyProcess
from gyre.records.io import read_records

MESSAGES = [{"role": "user", "content": "Summarise the repository layout and list the test commands. " * 4}]
SYSTEM = "You are a coding agent working in a sandbox."
MAX_TOKENS = 4


async def mixed_round(engine_url: str, proxy_url: str, ids: list[int], keys: list[str], calls: int, think_s: float):
    """Each session alternates a direct engine call and a proxy call, so both see the same load."""
    body = {"model": "gyre", "max_tokens": MAX_TOKENS, "system": SYSTEM, "messages": MESSAGES}
    stops = ByteTokenizer().stop_token_ids

    async def one(key: str) -> tuple[list[float], list[float]]:
        direct, through = [], []
        async with EngineClient(engine_url, timeout_s=300) as c, aiohttp.ClientSession(headers={"x-api-key": key}) as s:
            for i in range(2 * calls):
                t = time.perf_counter()
                if i % 2 == 0:
                    await c.generate(ids, {"max_new_tokens": MAX_TOKENS, "stop_token_ids": stops})
                    direct.append(time.perf_counter() - t)
                else:
                    async with s.post(proxy_url + "/v1/messages", json=body) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
                    through.append(time.perf_counter() - t)
                await asyncio.sleep(think_s)
        return direct, through

    return await asyncio.gather(*(one(k) for k in keys))


def new_keys(proxy: ProxyProcess, prefix: str, n: int) -> list[str]:
    import urllib.request

    keys = []
    for i in range(n):
        req = urllib.request.Request(proxy.url + "/admin/executions", data=json.dumps({"execution_id": f"{prefix}{i}"}).encode(),
                                     headers={"Authorization": f"Bearer {proxy.admin_token}"}, method="POST")  # fmt: skip
        with urllib.request.urlopen(req) as r:
            keys.append(json.loads(r.read())["api_key"])
    return keys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--think-ms", type=float, default=0.0, help="pause after each call (a harness running its tools)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gyre-bench-proxy-"))
    engine = BuiltinEngineProcess(EngineConfig(max_running_requests=args.sessions, startup_timeout_s=120), ModelConfig())
    engine.start()
    proxy = ProxyProcess(ProxyConfig(records_dir=str(tmp / "records"), engines=[engine.url])).start()
    ids = ByteTokenizer().apply_chat_template([{"role": "system", "content": SYSTEM}, *MESSAGES])
    direct, through, proxy_cpu_s, wall_s = [], [], 0.0, 0.0
    client_s: dict[str, list[float]] = {}  # execution id -> its proxied calls' wall times, in order
    try:
        cpu = psutil.Process(proxy.proc.pid)
        asyncio.run(mixed_round(engine.url, proxy.url, ids, new_keys(proxy, "warm", 4), 2, 0))  # warm both paths
        for r in range(args.rounds):
            keys = new_keys(proxy, f"r{r}-", args.sessions)
            c0, t0 = sum(cpu.cpu_times()[:2]), time.perf_counter()
            per_session = asyncio.run(mixed_round(engine.url, proxy.url, ids, keys, args.calls, args.think_ms / 1e3))
            wall_s += time.perf_counter() - t0
            proxy_cpu_s += sum(cpu.cpu_times()[:2]) - c0
            for i, (d, p) in enumerate(per_session):
                direct += d
                through += p
                client_s[f"r{r}-{i}"] = p
    finally:
        proxy.stop()
        engine.stop()
    records = [r for p in (tmp / "records").glob("r*.jsonl") for r in read_records(p)[0]]
    num_records = len(records)
    assert num_records == args.rounds * args.sessions * args.calls, num_records
    inside = np.array([r.hints["proxy_ms"] for r in records])
    # Paired per call: what the client waited minus the engine call the proxy made for it (one
    # HTTP round trip to the engine, as a direct call has), so engine-load noise cancels out.
    paired = np.array([client_s[r.execution_id][r.seq] * 1e3 - r.hints["engine_ms"] for r in records])
    d, p = np.array(direct) * 1e3, np.array(through) * 1e3
    out = {"added_ms_p50": float(np.percentile(p, 50) - np.percentile(d, 50)),
           "added_ms_p99": float(np.percentile(p, 99) - np.percentile(d, 99)),
           "direct_ms_p50": float(np.percentile(d, 50)), "direct_ms_p99": float(np.percentile(d, 99)),
           "proxy_ms_p50": float(np.percentile(p, 50)), "proxy_ms_p99": float(np.percentile(p, 99)),
           "paired_added_ms_p50": float(np.percentile(paired, 50)),
           "paired_added_ms_p99": float(np.percentile(paired, 99)),
           "in_proxy_ms_p50": float(np.percentile(inside, 50)), "in_proxy_ms_p99": float(np.percentile(inside, 99)),
           "records_per_s": num_records / wall_s, "proxy_cpu_ms_per_call": proxy_cpu_s / len(through) * 1e3,
           "think_ms": args.think_ms, "num_sessions": args.sessions,
           "calls_per_session": args.calls, "rounds": args.rounds, "cpus": os.cpu_count()}  # fmt: skip
    print(f"{'path':<8}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{'direct':<8}{out['direct_ms_p50']:>10.2f}{out['direct_ms_p99']:>10.2f}")
    print(f"{'proxy':<8}{out['proxy_ms_p50']:>10.2f}{out['proxy_ms_p99']:>10.2f}")
    print(f"{'paired':<8}{out['paired_added_ms_p50']:>10.2f}{out['paired_added_ms_p99']:>10.2f}   (per call: client wait minus the proxy's engine call)")
    print(f"{'in proxy':<8}{out['in_proxy_ms_p50']:>10.2f}{out['in_proxy_ms_p99']:>10.2f}   (call time minus engine time, before the record's fsync)")
    print(f"added p50 {out['added_ms_p50']:.2f} ms, p99 {out['added_ms_p99']:.2f} ms; {out['records_per_s']:.1f} records/s; "
          f"proxy CPU {out['proxy_cpu_ms_per_call']:.2f} ms per call")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
