"""Records file benchmark: write (one fsync per record, as the proxy does) and read back the
synthetic Claude-Code-like execution of tools/bench/trajectory.py (~430 calls, ~21M summed input
tokens, ~700K unique tokens).

Prints a table, then ONE JSON object on the last line:
  write_s, write_nofsync_s   wall time to append every record (with / without fsync per record)
  read_s                     wall time of read_records (parse, decode, delta-rebuild, validate)
  file_mb                    bytes on disk; full_inputs_mb: what storing each input whole would take
  logical_tokens             summed input+output tokens the records describe
  write_tokens_per_s, read_tokens_per_s   logical tokens per second

Usage: PYTHONPATH=. python tools/bench/records.py [--dir DIR] [--scale 1.0]
       [--smoke]   (the test suite's run: every figure at 2% of the tokens)
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from gyre.common import jsonio
from gyre.records import RecordWriter, read_records

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "unit"))
from _synthetic import make_claude_like


def write_all(path: str, records, fsync: bool) -> float:
    if os.path.exists(path):
        os.remove(path)
    t0 = time.perf_counter()
    with RecordWriter(path, fsync=fsync) as w:
        for r in records:
            w.append(r)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--smoke", action="store_true", help="smallest sizes, seconds (the test suite's run)")
    args = ap.parse_args()
    if args.smoke:
        args.scale = 0.02
    records = make_claude_like(scale=args.scale, num_rewinds=1).records
    logical = sum(r.num_tokens for r in records)
    # input + output ids and the log-probs, 4 bytes each, base64 (4/3)
    full_inputs_bytes = sum(4 * (r.num_tokens + r.output_ids.size) * 4 / 3 for r in records)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "execution.jsonl")
        write_nofsync_s = write_all(path, records, fsync=False)
        write_s = write_all(path, records, fsync=True)
        size = os.path.getsize(path)
        t0 = time.perf_counter()
        back, stats = read_records(path)
        read_s = time.perf_counter() - t0
    assert len(back) == len(records) and stats.num_torn == 0 and not stats.invalid
    out = {
        "num_records": len(records),
        "logical_tokens": logical,
        "write_s": round(write_s, 3),
        "write_nofsync_s": round(write_nofsync_s, 3),
        "read_s": round(read_s, 3),
        "file_mb": round(size / 2**20, 2),
        "full_inputs_mb": round(full_inputs_bytes / 2**20, 1),
        "write_tokens_per_s": round(logical / write_s),
        "read_tokens_per_s": round(logical / read_s),
        "write_records_per_s": round(len(records) / write_s, 1),
    }
    print(
        f"{len(records)} records, {logical:,} logical tokens, file {size / 2**20:.1f} MB "
        f"(whole inputs would be {full_inputs_bytes / 2**20:.0f} MB)"
    )
    print(
        f"write {write_s:.3f} s with fsync per record ({write_nofsync_s:.3f} s without) = "
        f"{len(records) / write_s:.0f} records/s; read {read_s:.3f} s = {logical / read_s / 1e6:.1f}M tokens/s"
    )
    print(jsonio.dumps(out))


if __name__ == "__main__":
    main()
