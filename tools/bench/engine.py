"""Builtin engine benchmark: decode throughput under concurrency, and prefill saved by reuse.

Prints a table, then ONE JSON object on the last line:
  tokens_per_s.{1,8,32}         completion tokens / wall second with N concurrent requests (--concurrency)
  prefix_cache                  cold vs cached latency of a long prompt on one engine (1 new token)
  kv_import                     on a second engine: recompute vs migrate-over-Mooncake + generate

With --long-context N,M,... it instead prefills one N-token prompt per fresh engine process (a
1-layer model, 8K prefill chunks, as the Claude Code runs on main) and reports, per length:
  long_context.N.{peak_rss_mb, prefill_tokens_per_cpu_s, prefill_tokens_per_wall_s}
(peak RSS is the engine process's VmHWM, CPU time its utime+stime, both from /proc) and
`rss_ratio` = peak RSS at the longest / at the shortest length.

Usage: PYTHONPATH=. python tools/bench/engine.py [--new-tokens 64] [--prefix-tokens 2000] [--threads 1]
           [--model-path HF_DIR] [--concurrency 1,8,32]
       PYTHONPATH=. python tools/bench/engine.py --long-context 32768,131072
       PYTHONPATH=. python tools/bench/engine.py --smoke   (the test suite's run: the default figures at
           4 new tokens, concurrency 1 and 2, a 64-token prefix; not --long-context)
"""

import argparse
import asyncio
import os
import time

import torch

from gyre.common import jsonio
from gyre.engines.client import EngineClient, migrate_prefixes
from gyre.engines.config import EngineConfig
from gyre.engines.launch import BuiltinEngineProcess
from gyre.models.config import ModelConfig


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def throughput(c: EngineClient, concurrency: int, new_tokens: int, prompt_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    reqs = [c.generate(_ids(prompt_tokens, 1000 + i), {**params, "sampling_seed": i}) for i in range(concurrency)]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*reqs)
    wall = time.perf_counter() - t0
    return sum(o["meta_info"]["completion_tokens"] for o in outs) / wall


async def timed_generate(c: EngineClient, ids: list[int]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = await c.generate(ids, {"max_new_tokens": 1, "temperature": 0})
    return time.perf_counter() - t0, out


async def run(a_url: str, b_url: str, args) -> dict:
    result: dict = {"tokens_per_s": {}}
    async with EngineClient(a_url) as a, EngineClient(b_url) as b:
        await throughput(a, 2, 4, 16)  # warm-up
        for n in args.concurrency:
            result["tokens_per_s"][str(n)] = round(await throughput(a, n, args.new_tokens, args.prompt_tokens), 1)
            await a.flush_cache()
        prefix = _ids(args.prefix_tokens, 7)
        cold_s, _ = await timed_generate(a, prefix)
        warm_s, warm = await timed_generate(a, prefix)
        result["prefix_cache"] = {
            "prompt_tokens": len(prefix),
            "cold_s": round(cold_s, 4),
            "cached_s": round(warm_s, 4),
            "cached_tokens": warm["meta_info"]["cached_tokens"],
            "saved_s": round(cold_s - warm_s, 4),
        }
        recompute_s, _ = await timed_generate(b, _ids(args.prefix_tokens, 8))  # B computes a same-size prompt itself
        t0 = time.perf_counter()
        [moved] = await migrate_prefixes(a, b, [(prefix, 0)])
        transfer_s = time.perf_counter() - t0
        after_s, after = await timed_generate(b, prefix)
        result["kv_import"] = {
            **moved,
            "recompute_s": round(recompute_s, 4),
            "transfer_s": round(transfer_s, 4),
            "generate_after_import_s": round(after_s, 4),
            "cached_tokens": after["meta_info"]["cached_tokens"],
            "saved_s": round(recompute_s - transfer_s - after_s, 4),
        }
    return result


def _proc_cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_peak_rss_mb(pid: int) -> float:
    line = next(ln for ln in open(f"/proc/{pid}/status") if ln.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def long_context(lengths: list[int], threads: int) -> dict:
    """Peak RSS and prefill speed of one long prompt per fresh engine (same model for every length)."""
    model = ModelConfig(name="long-1layer", num_layers=1, max_seq_len=max(lengths) + 16)
    cfg = EngineConfig(startup_timeout_s=120, max_prefill_tokens=8192, request_timeout_s=3600)
    out = {}
    for n in lengths:
        with BuiltinEngineProcess(cfg, model, threads) as eng:
            pid = eng.proc.pid
            cpu0, t0 = _proc_cpu_s(pid), time.perf_counter()
            reply = asyncio.run(_one(eng.url, _ids(n, 3)))
            wall, cpu = time.perf_counter() - t0, _proc_cpu_s(pid) - cpu0
            out[str(n)] = {
                "peak_rss_mb": round(_proc_peak_rss_mb(pid), 1),
                "prefill_tokens_per_cpu_s": round(n / cpu, 1),
                "prefill_tokens_per_wall_s": round(n / wall, 1),
                "prompt_tokens": reply["meta_info"]["prompt_tokens"],
            }
        print(
            f"{n:>7} tokens: peak RSS {out[str(n)]['peak_rss_mb']} MB, "
            f"{out[str(n)]['prefill_tokens_per_cpu_s']} prefill tokens/CPU-s"
        )
    lo, hi = str(min(lengths)), str(max(lengths))
    return {
        "long_context": out,
        "rss_ratio": round(out[hi]["peak_rss_mb"] / out[lo]["peak_rss_mb"], 3),
        "model": model.name,
        "threads": threads,
    }


async def _one(url: str, ids: list[int]) -> dict:
    async with EngineClient(url, timeout_s=7200) as c:  # a 128K prefill takes minutes of CPU
        return await c.generate(ids, {"max_new_tokens": 1, "temperature": 0})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--model-path", default=None, help="serve this HF checkpoint directory instead of the tiny model")
    p.add_argument(
        "--concurrency", default="1,8,32", type=lambda v: [int(n) for n in v.split(",")], help="comma-separated"
    )
    p.add_argument("--long-context", default="", help="comma-separated prompt lengths: measure long prefills instead")
    p.add_argument("--smoke", action="store_true", help="smallest sizes, seconds (the test suite's run)")
    args = p.parse_args()
    if args.smoke:
        args.new_tokens, args.prompt_tokens, args.prefix_tokens, args.concurrency = 4, 16, 64, [1, 2]
    if args.long_context:
        print(jsonio.dumps(long_context([int(n) for n in args.long_context.split(",")], args.threads)))
        return
    model = ModelConfig(name="hf", path=args.model_path) if args.model_path else ModelConfig()
    cfg = EngineConfig(startup_timeout_s=600)
    with BuiltinEngineProcess(cfg, model, args.threads) as a, BuiltinEngineProcess(cfg, model, args.threads) as b:
        result = asyncio.run(run(a.url, b.url, args))
    result |= {
        "model": model.name,
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "prompt_tokens": args.prompt_tokens,
    }
    for n, tps in result["tokens_per_s"].items():
        print(f"{n:>3} concurrent: {tps:8.1f} tokens/s")
    pc, kv = result["prefix_cache"], result["kv_import"]
    print(
        f"prefix cache ({pc['prompt_tokens']} tokens): cold {pc['cold_s']} s, cached {pc['cached_s']} s "
        f"({pc['cached_tokens']} cached)"
    )
    print(
        f"KV import: recompute {kv['recompute_s']} s vs transfer {kv['transfer_s']} s + generate "
        f"{kv['generate_after_import_s']} s "
        f"({kv['transferred_tokens']} transferred, {kv['recomputed_tokens']} recomputed)"
    )
    print(jsonio.dumps(result))


if __name__ == "__main__":
    main()
