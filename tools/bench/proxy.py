"""Proxy benchmark: latency the proxy adds over calling the engine directly, and records written.

One builtin engine (tiny model, random policy, 4 new tokens per call) serves N concurrent sessions
that each make `--calls` rotations of the same ~300-token conversation: (a) straight to the
engine's /generate with the prompt ids the proxy would render, (b) through the proxy's Anthropic
API (auth, parsing, token-faithful rendering, routing, the engine call, output parsing, one record
written per call, fsynced by the group commit), and with `--compare-fsync-each` (c) through a
second proxy that fsyncs every record before answering (`fsync_window_ms=0`, the old behaviour).
All paths run side by side in one run, so they see the same engine load and CPU contention.

Two estimates of the added latency, both printed:
  added (difference)  percentile(proxied) - percentile(direct) of per-call wall times: what the
                      harness sees; but engine batching makes both ~1 s with a wide spread, so it
                      moves by tens of ms between runs: read it over repeated runs.
  paired (per call)   the client's wait for a proxied call minus the engine call the proxy made
                      for it (`engine_ms` in the record): engine-load noise cancels; it leaves out
                      the proxy's wake-up for the engine's answer (inside `engine_ms`) and keeps
                      this client's wake-up for the proxy's answer (a direct call has one too), so
                      it is the proxy's share without engine noise, not a bound.
Where the added time goes on a small shared box (the proxy is a Python event loop):
  proxy_cpu_ms_per_call  CPU of the proxy process per call (all threads; the cost that transfers)
  proxy_loop_cpu_ms_per_call  the same for its event-loop thread alone (/proc schedstat)
  proxy_runq_ms_per_call time the proxy's event-loop thread was runnable but waiting for a CPU, per
                         call (/proc schedstat): other processes (the engine, this client, other
                         users) holding the cores
  proxy_wake_wait_ms     the same per time the loop got a CPU: a proxied call needs the proxy's loop
                         to wake twice (its request, the engine's answer) where a direct call needs
                         neither, so it waits about twice this plus the proxy's CPU per call
  in_proxy_ms_p50/p99    per call, the handler's time outside engine calls, from the records
  client_*               the same schedstat figures for this client's own event loop (all paths)
  burst_p50              per call, how many of the proxy's calls got their engine answer within the
                         10 ms before it (itself included)
  The engine finishes a batch of calls in the same step, so their answers reach the proxy as a
  burst that one thread handles in turn: the k-th waits ~k x the per-call CPU.

`--pin` puts the engine on CPU 0 and the proxies and this client on the other CPUs
(os.sched_setaffinity), so an engine step never delays the proxy's loop on the same core.

Last line: ONE JSON object: added_ms_p50/p99 (difference), paired_added_ms_p50/p99, direct_ms_*,
proxy_ms_*, in_proxy_ms_*, records_per_s (records written per second of the measured rounds, all
proxies), the proxy_* figures above, and with --compare-fsync-each the same figures prefixed `each_`.

Usage: PYTHONPATH=. python tools/bench/proxy.py [--sessions 64] [--calls 10] [--rounds 3]
           [--think-ms 0] [--fsync-window-ms 50] [--compare-fsync-each] [--pin]
       PYTHONPATH=. python tools/bench/proxy.py --smoke   (the test suite's run: every path above, the
           fsync-each proxy included, for 2 sessions of 2 calls in one round)
"""

import argparse
import asyncio
import os
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np
import psutil

from gyre.common import jsonio
from gyre.engines.client import EngineClient
from gyre.engines.config import EngineConfig
from gyre.engines.launch import BuiltinEngineProcess
from gyre.models.config import ModelConfig
from gyre.models.tokenizer import ByteTokenizer
from gyre.proxy.config import ProxyConfig
from gyre.proxy.main import ProxyProcess
from gyre.records.io import read_records

TASK = "Summarise the repository layout and list the test commands. "
MESSAGES = [{"role": "user", "content": TASK * 4}]
SYSTEM = "You are a coding agent working in a sandbox."
MAX_TOKENS = 4


async def mixed_round(
    engine_url: str, proxies: list[tuple[str, list[str]]], ids: list[int], calls: int, think_s: float, seed: int
):
    """Each session makes `calls` rotations of one direct call and one call per proxy, in a random
    order per rotation (sessions in step with the engine's batches would otherwise give each path
    its own batch phase), pausing an exponential time of mean `think_s` after each call.

    Returns per session: (direct wall times, [wall times through each proxy]).
    """
    body = {"model": "gyre", "max_tokens": MAX_TOKENS, "system": SYSTEM, "messages": MESSAGES}
    stops = ByteTokenizer().stop_token_ids

    async def one(i: int) -> tuple[list[float], list[list[float]]]:
        rng = np.random.default_rng([seed, i])
        direct, through = [], [[] for _ in proxies]
        async with EngineClient(engine_url, timeout_s=300) as c, aiohttp.ClientSession() as s:
            for _ in range(calls):
                for k in rng.permutation(len(proxies) + 1) - 1:
                    t = time.perf_counter()
                    if k < 0:
                        await c.generate(ids, {"max_new_tokens": MAX_TOKENS, "stop_token_ids": stops})
                        direct.append(time.perf_counter() - t)
                    else:
                        url, keys = proxies[k]
                        async with s.post(url + "/v1/messages", json=body, headers={"x-api-key": keys[i]}) as r:
                            assert r.status == 200, await r.text()
                            await r.read()
                        through[k].append(time.perf_counter() - t)
                    await asyncio.sleep(rng.exponential(think_s) if think_s else 0)
        return direct, through

    return await asyncio.gather(*(one(i) for i in range(len(proxies[0][1]))))


def prompt_ids() -> list[int]:
    """The ids the proxy renders for the bench's conversation (what direct calls send)."""
    return ByteTokenizer().apply_chat_template([{"role": "system", "content": SYSTEM}, *MESSAGES])


def new_keys(proxy: ProxyProcess, prefix: str, n: int) -> list[str]:
    keys = []
    for i in range(n):
        req = urllib.request.Request(
            proxy.url + "/admin/executions",
            data=jsonio.dumps({"execution_id": f"{prefix}{i}"}).encode(),
            headers={"Authorization": f"Bearer {proxy.admin_token}"},
            method="POST",
        )
        with urllib.request.urlopen(req) as r:
            keys.append(jsonio.loads(r.read())["api_key"])
    return keys


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` and of its child processes onto `cpus` (affinity is per thread)."""
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        for t in p.threads():
            os.sched_setaffinity(t.id, cpus)


def loop_sched(pid: int) -> np.ndarray:
    """The process's main (event-loop) thread: seconds run on a CPU, seconds runnable but waiting
    for one, and the number of times it got one (/proc schedstat)."""
    return np.array(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[:3], dtype=float) / [1e9, 1e9, 1]


def pct(a, q: float) -> float:
    return float(np.percentile(a, q))


def figures(
    direct: np.ndarray,
    through: np.ndarray,
    records: list,
    wall_s: dict[str, list[float]],
    cpu_s: float,
    loop: np.ndarray,
) -> dict:
    """One proxy's figures (ms) from per-call wall times and its records."""
    paired = np.array([wall_s[r.execution_id][r.seq] * 1e3 - r.hints["engine_ms"] for r in records])
    inside = np.array([r.hints["proxy_ms"] for r in records])
    ends = np.sort([r.started_at + r.hints["engine_ms"] / 1e3 for r in records])  # engine answers, proxy clock
    burst = np.searchsorted(ends, ends, side="right") - np.searchsorted(ends, ends - 0.01)  # answers in the last 10 ms
    return {
        "added_ms_p50": pct(through, 50) - pct(direct, 50),
        "added_ms_p99": pct(through, 99) - pct(direct, 99),
        "paired_added_ms_p50": pct(paired, 50),
        "paired_added_ms_p99": pct(paired, 99),
        "proxy_ms_p50": pct(through, 50),
        "proxy_ms_p99": pct(through, 99),
        "in_proxy_ms_p50": pct(inside, 50),
        "in_proxy_ms_p99": pct(inside, 99),
        "proxy_cpu_ms_per_call": cpu_s / len(through) * 1e3,
        "proxy_loop_cpu_ms_per_call": loop[0] / len(through) * 1e3,
        "proxy_runq_ms_per_call": loop[1] / len(through) * 1e3,
        "proxy_wake_wait_ms": loop[1] / max(loop[2], 1) * 1e3,
        "burst_p50": pct(burst, 50),
    }


def measure(args, engine_url: str, proxies: list[ProxyProcess]) -> tuple:
    """The measured rounds: per-call wall times, and each proxy's CPU and loop schedstat deltas."""
    ids = prompt_ids()
    asyncio.run(mixed_round(engine_url, [(p.url, new_keys(p, "warm", 4)) for p in proxies], ids, 2, 0, 1000))
    procs = [psutil.Process(p.proc.pid) for p in proxies]
    direct, through = [], [[] for _ in proxies]
    wall_s: list[dict[str, list[float]]] = [{} for _ in proxies]  # execution id -> its calls' wall times
    cpu, loop, me, measured_s = np.zeros(len(proxies)), np.zeros((len(proxies), 3)), np.zeros(3), 0.0
    for r in range(args.rounds):
        keyed = [(p.url, new_keys(p, f"r{r}-", args.sessions)) for p in proxies]
        c0 = np.array([sum(p.cpu_times()[:2]) for p in procs])
        q0, me0 = np.array([loop_sched(p.pid) for p in procs]), loop_sched(os.getpid())
        t0 = time.perf_counter()
        per_session = asyncio.run(mixed_round(engine_url, keyed, ids, args.calls, args.think_ms / 1e3, r))
        measured_s += time.perf_counter() - t0
        cpu += np.array([sum(p.cpu_times()[:2]) for p in procs]) - c0
        loop += np.array([loop_sched(p.pid) for p in procs]) - q0
        me += loop_sched(os.getpid()) - me0
        for i, (d, ps) in enumerate(per_session):
            direct += d
            for k, p in enumerate(ps):
                through[k] += p
                wall_s[k][f"r{r}-{i}"] = p
    return np.array(direct) * 1e3, through, wall_s, cpu, loop, me, measured_s


def run(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="gyre-bench-proxy-"))
    model = ModelConfig(max_seq_len=max(ModelConfig().max_seq_len, 2 * len(prompt_ids())))
    engine = BuiltinEngineProcess(EngineConfig(max_running_requests=args.sessions, startup_timeout_s=120), model)
    windows = [args.fsync_window_ms] + ([0.0] if args.compare_fsync_each else [])
    proxies: list[ProxyProcess] = []
    try:
        engine.start()
        for k, window in enumerate(windows):
            proxies.append(
                ProxyProcess(
                    ProxyConfig(records_dir=str(tmp / f"records{k}"), engines=[engine.url], fsync_window_ms=window)
                ).start()
            )
        if args.pin:
            others = set(range(1, os.cpu_count()))
            pin(engine.proc.pid, {0})
            for p in proxies:
                pin(p.proc.pid, others)
            os.sched_setaffinity(0, others)
        d, through, wall_s, cpu, loop, me, measured_s = measure(args, engine.url, proxies)
    finally:
        for p in proxies:
            p.stop()
        engine.stop()
    num_calls = d.size * (1 + len(proxies))
    out = {
        "direct_ms_p50": pct(d, 50),
        "direct_ms_p99": pct(d, 99),
        "client_loop_cpu_ms_per_call": me[0] / num_calls * 1e3,
        "client_wake_wait_ms": me[1] / max(me[2], 1) * 1e3,
    }
    num_records = 0
    for k in range(len(proxies)):
        records = [x for f in (tmp / f"records{k}").glob("r*.jsonl") for x in read_records(f)[0]]
        assert len(records) == args.rounds * args.sessions * args.calls, len(records)
        num_records += len(records)
        fig = figures(d, np.array(through[k]) * 1e3, records, wall_s[k], cpu[k], loop[k])
        out.update({("each_" if k else "") + name: v for name, v in fig.items()})
    shutil.rmtree(tmp)
    out.update(
        {
            "records_per_s": num_records / measured_s,
            "fsync_window_ms": args.fsync_window_ms,
            "pinned": args.pin,
            "think_ms": args.think_ms,
            "num_sessions": args.sessions,
            "calls_per_session": args.calls,
            "rounds": args.rounds,
            "prompt_tokens": len(prompt_ids()),
            "cpus": os.cpu_count(),
            "loadavg_1m": os.getloadavg()[0],
        }
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--think-ms", type=float, default=0.0, help="mean pause after each call (a harness running its tools)"
    )
    ap.add_argument("--fsync-window-ms", type=float, default=ProxyConfig().fsync_window_ms)
    ap.add_argument(
        "--compare-fsync-each", action="store_true", help="also a proxy that fsyncs each record before answering"
    )
    ap.add_argument("--pin", action="store_true", help="engine on CPU 0, proxies and this client on the others")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="pad the conversation to about this many tokens")
    ap.add_argument("--smoke", action="store_true", help="smallest sizes, seconds (the test suite's run)")
    args = ap.parse_args()
    if args.smoke:
        args.sessions, args.calls, args.rounds, args.compare_fsync_each = 2, 2, 1, True
    if args.prompt_tokens:  # the byte tokenizer: one token per byte
        MESSAGES[0]["content"] = TASK * max(4, args.prompt_tokens // len(TASK))
    out = run(args)
    print_report(out)
    print(jsonio.dumps(out))


def print_report(out: dict) -> None:
    print(f"{'path':<22}{'p50 ms':>9}{'p99 ms':>9}")
    print(f"{'direct':<22}{out['direct_ms_p50']:>9.2f}{out['direct_ms_p99']:>9.2f}")
    for pre, name in [("", f"proxy (window {out['fsync_window_ms']:g} ms)"), ("each_", "proxy (fsync each)")]:
        if pre + "proxy_ms_p50" not in out:
            continue
        g = {
            k: out[pre + k]
            for k in (
                "proxy_ms_p50",
                "proxy_ms_p99",
                "added_ms_p50",
                "added_ms_p99",
                "paired_added_ms_p50",
                "paired_added_ms_p99",
                "in_proxy_ms_p50",
                "in_proxy_ms_p99",
            )
        }
        print(f"{name:<22}{g['proxy_ms_p50']:>9.2f}{g['proxy_ms_p99']:>9.2f}")
        print(
            f"{'  added, difference':<22}{g['added_ms_p50']:>9.2f}{g['added_ms_p99']:>9.2f}   (proxied minus "
            "direct percentiles)"
        )
        print(
            f"{'  added, paired':<22}{g['paired_added_ms_p50']:>9.2f}{g['paired_added_ms_p99']:>9.2f}   "
            "(client wait minus the proxy's engine call)"
        )
        print(
            f"{'  in proxy':<22}{g['in_proxy_ms_p50']:>9.2f}{g['in_proxy_ms_p99']:>9.2f}   (handler time "
            "outside engine calls)"
        )
        print(
            f"  proxy CPU {out[pre + 'proxy_cpu_ms_per_call']:.2f} ms/call "
            f"({out[pre + 'proxy_loop_cpu_ms_per_call']:.2f} "
            f"in its event loop), the loop waited for a CPU "
            f"{out[pre + 'proxy_runq_ms_per_call']:.2f} ms/call, {out[pre + 'proxy_wake_wait_ms']:.2f} ms per wake-up; "
            f"{out[pre + 'burst_p50']:.0f} engine answers (p50, itself included) within 10 ms of each"
        )
    print(
        f"this client: {out['client_loop_cpu_ms_per_call']:.2f} ms CPU per call, {out['client_wake_wait_ms']:.2f} ms "
        "wait for a CPU per wake-up"
    )
    print(f"{out['records_per_s']:.1f} records/s; load average {out['loadavg_1m']:.1f} on {out['cpus']} CPUs")


if __name__ == "__main__":
    main()
