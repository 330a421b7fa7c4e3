"""Event emission benchmark: what `EventLog.emit` costs on the hot path (the proxy emits one
ModelCall per model call; the coordinator an ObservationEvent a second).

Side by side in one run, rounds alternating so both see the same machine load: the caller's hot
path, building each event and handing it to `EventLog.emit` (encode + one O_APPEND os.write), and
the same loop with a no-op sink of the same call signature. Costs are CPU time of this process
(user + system, the kernel's per-process clock via time.process_time, ns resolution: /proc's
10 ms ticks cannot resolve the no-op loop), so other sessions' load on the shared box does not count.

Prints a table, then ONE JSON object on the last line:
  <kind>_emit_us, <kind>_noop_us   CPU microseconds per event (median over rounds): build + emit, build + no-op
  <kind>_overhead_us               emit - noop: what the sink adds to the caller
  budget_us                        the issue's bound on the hot path (20 us)
  within_budget                    every kind's whole hot path (build + emit) <= budget_us

Usage: PYTHONPATH=. python tools/bench/metrics.py [--events 20000] [--rounds 7] [--dir DIR]
       [--smoke]   (the test suite's run: one round of 200 events per kind)
"""

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from gyre.common import jsonio
from gyre.metrics.events import Event, ModelCall, ObservationEvent
from gyre.metrics.log import EventLog

BUDGET_US = 20.0


class NoopLog:
    """The no-op sink: EventLog's interface, doing nothing."""

    def emit(self, event: Event) -> None:
        pass


def per_event_us(sink, build: Callable[[int], Event], n: int) -> float:
    """CPU microseconds per event of the caller's loop: build the event (time stamp included), emit it."""
    emit = sink.emit
    t0 = time.process_time()
    for i in range(n):
        emit(build(i))
    return (time.process_time() - t0) / n * 1e6


ROLES = ["train", "rollout", "rollout", "train"] * 2
SESSIONS = [0, 250, 240, 0, 0, 260, 230, 0]
EXECUTIONS = [f"exec-{i:04d}" for i in range(512)]
ENGINES = [f"engine-{i}" for i in range(6)]
"""The proxy holds these strings already; building them per event is no cost of emitting."""
BUILDERS: dict[str, Callable[[int], Event]] = {
    "model_call": lambda i: ModelCall(
        execution_id=EXECUTIONS[i % 512],
        agent_id="main",
        cell=i % 6,
        engine_id=ENGINES[i % 6],
        prompt_tokens=120_000 + i,
        output_tokens=350,
        cached_tokens=119_000,
        latency_s=2.5,
    ),
    "observation": lambda i: ObservationEvent(queued=40, running=980, roles=ROLES, sessions=SESSIONS),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=20000, help="events per round and kind")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None, help="run directory to write into (default: a temporary one)")
    ap.add_argument("--smoke", action="store_true", help="smallest sizes, seconds (the test suite's run)")
    args = ap.parse_args()
    if args.smoke:
        args.events, args.rounds = 200, 1
    out: dict[str, float | bool] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as run_dir:
        log = EventLog(run_dir)
        noop = NoopLog()
        print(
            f"{'event':<14} {'build+emit us':>14} {'build+no-op us':>15} {'emit us':>8}   "
            f"(CPU, median of {args.rounds} rounds x {args.events})"
        )
        for kind, build in BUILDERS.items():
            emit_us, noop_us = [], []
            for _ in range(args.rounds):
                emit_us.append(per_event_us(log, build, args.events))
                noop_us.append(per_event_us(noop, build, args.events))
            e, n = statistics.median(emit_us), statistics.median(noop_us)
            out |= {
                f"{kind}_emit_us": round(e, 2),
                f"{kind}_noop_us": round(n, 2),
                f"{kind}_overhead_us": round(e - n, 2),
            }
            print(f"{kind:<14} {e:>14.2f} {n:>15.2f} {e - n:>8.2f}")
        file_mb = os.path.getsize(log.path) / 1e6
        log.close()
        assert log.num_dropped == 0, "the benchmark's own writes failed"
    out |= {
        "file_mb": round(file_mb, 1),
        "budget_us": BUDGET_US,
        "within_budget": all(v <= BUDGET_US for k, v in out.items() if k.endswith("_emit_us")),
    }
    print(jsonio.dumps(out))


if __name__ == "__main__":
    main()
