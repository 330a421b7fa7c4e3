"""Trajectory processor benchmark: one synthetic Claude-Code-like execution (~700K tokens over ~430
calls, 3 compactions, 6 sub-agents, a duplicate re-send per segment, an auxiliary call, and one
tool-result clearing that abandons a branch) from in-memory records to a packed batch.

Prints a table, then ONE JSON object on the last line:
  seconds        median wall time of tree + paths + selection + dedup + weights + pack (K paths)
  peak_mb        peak traced numpy/Python memory of one run, the execution's records included
  seconds_2x     the same at 2x the tokens (same calls); ratio_2x = seconds_2x / seconds
  tokens_naive   targets trained if every path were its own sample (no cap, no dedup)
  tokens_capped  targets on the K selected paths
  tokens_dedup   targets on the K selected paths, each shared target once (what the loss counts)
  seq_tokens_{naive,capped,packed,tree}  sequence tokens to compute: every path / K paths /
                 K paths packed (paths left without unique targets dropped) / prefix-tree packing
  input_tokens   summed input length of all calls (what the records describe)
Targets on the 2-core dev machine: seconds <= 2, peak_mb <= 1024, ratio_2x <= 2.2.

Usage: PYTHONPATH=. python tools/bench/trajectory.py [--repeats 5] [--max-paths 5] [--rewinds 1] [--scale 1.0]
       [--smoke]   (the test suite's run: every figure once, at 2% of the tokens)
"""

import argparse
import resource
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

from gyre.common import jsonio
from gyre.trajectory.config import TrajectoryConfig
from gyre.trajectory.pack import pack
from gyre.trajectory.process import process_execution, weight_samples

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "unit"))
from _synthetic import make_claude_like


def run_once(records, config: TrajectoryConfig):
    result = process_execution(records, config)
    batch = pack(weight_samples(result, 1.0, config))
    return result, batch


def timed(records, config: TrajectoryConfig, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run_once(records, config)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_mb(scale: float, rewinds: int, config: TrajectoryConfig) -> float:
    tracemalloc.start()
    records = make_claude_like(scale=scale, num_rewinds=rewinds).records
    tracemalloc.reset_peak()
    run_once(records, config)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-paths", type=int, default=5)
    ap.add_argument("--rewinds", type=int, default=1)
    ap.add_argument("--scale", type=float, default=1.0, help="tokens per call, relative to the default execution")
    ap.add_argument("--smoke", action="store_true", help="smallest sizes, seconds (the test suite's run)")
    args = ap.parse_args()
    if args.smoke:
        args.repeats, args.scale = 1, 0.02
    config = TrajectoryConfig(max_paths=args.max_paths)
    ex1 = make_claude_like(scale=args.scale, num_rewinds=args.rewinds)
    result, batch = run_once(ex1.records, config)
    seconds = timed(ex1.records, config, args.repeats)
    del ex1
    ex2 = make_claude_like(scale=2 * args.scale, num_rewinds=args.rewinds)
    seconds_2x = timed(ex2.records, config, args.repeats)
    input_tokens_2x = sum(r.input_ids.size for r in ex2.records)
    del ex2
    ex1 = make_claude_like(scale=args.scale, num_rewinds=args.rewinds)
    input_tokens = sum(r.input_ids.size for r in ex1.records)
    num_calls = len(ex1.records)
    del ex1
    peak = peak_mb(args.scale, args.rewinds, config)
    c = result.counts
    out = {
        "seconds": round(seconds, 4),
        "peak_mb": round(peak, 1),
        "seconds_2x": round(seconds_2x, 4),
        "ratio_2x": round(seconds_2x / seconds, 3),
        "tokens_naive": c.targets_naive,
        "tokens_capped": c.targets_capped,
        "tokens_dedup": c.targets_dedup,
        "seq_tokens_naive": c.seq_tokens_naive,
        "seq_tokens_capped": c.seq_tokens_capped,
        "seq_tokens_packed": c.seq_tokens_packed,
        "seq_tokens_tree": c.seq_tokens_tree,
        "input_tokens": input_tokens,
        "input_tokens_2x": input_tokens_2x,
        "num_calls": num_calls,
        "max_paths": args.max_paths,
        "packed_tokens": batch.num_tokens,
        "left_out": dict(result.left_out),
        "maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    print(
        f"calls {num_calls}, summed input {input_tokens:,} tokens; unique tokens on trainable paths "
        f"{c.seq_tokens_naive:,}"
    )
    print(
        f"process+pack  {seconds:.3f} s (target <= 2)   peak {peak:.0f} MB (target <= 1024)   "
        f"2x tokens {seconds_2x:.3f} s = {seconds_2x / seconds:.2f}x (target <= 2.2)"
    )
    print(f"targets       naive {c.targets_naive:,}  capped {c.targets_capped:,}  capped+dedup {c.targets_dedup:,}")
    print(
        f"seq tokens    naive {c.seq_tokens_naive:,}  capped {c.seq_tokens_capped:,}  packed "
        f"{c.seq_tokens_packed:,}  prefix-tree {c.seq_tokens_tree:,}"
    )
    print(f"paths left out {dict(result.left_out)}")
    print(jsonio.dumps(out))


if __name__ == "__main__":
    main()
