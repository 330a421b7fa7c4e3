"""Event emission benchmark: what `EventLog.emit` costs on the hot path (the proxy emits one
ModelCall per model call; the coordinator an Observation a second).

Side by side in one run, rounds alternating so both see the same machine load: the same
pre-built events through `EventLog.emit` (encode + one O_APPEND os.write) and through a no-op sink
with the same call signature. Costs are CPU time of this process (user + system, from
/proc/self/stat via os.times), so other sessions' load on the shared box does not count.

Prints a table, then ONE JSON object on the last line:
  <kind>_emit_us, <kind>_noop_us   CPU microseconds per event (median over rounds)
  <kind>_overhead_us               emit - noop: what emitting adds to the caller
  budget_us                        the issue's bound on the hot path (20 us)
  within_budget                    every kind's overhead <= budget_us

Usage: PYTHONPATH=. python tools/bench/metrics.py [--events 20000] [--rounds 7] [--dir DIR]
"""

import argparse
import json
import os
import statistics
import tempfile

from gyre.metrics.config import MetricsConfig
from gyre.metrics.events import Event, ModelCall, Observation
from gyre.metrics.log import EventLog

BUDGET_US = 20.0


class NoopLog:
    """The no-op sink: EventLog's interface, doing nothing."""

    def emit(self, event: Event) -> None:
        pass


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def per_event_us(sink, events: list[Event]) -> float:
    emit = sink.emit
    t0 = cpu_s()
    for e in events:
        emit(e)
    return (cpu_s() - t0) / len(events) * 1e6


def make_events(kind: str, n: int) -> list[Event]:
    if kind == "model_call":
        return [ModelCall(t=1.7e9 + i, execution_id=f"exec-{i % 512:04d}", agent_id="main", cell=i % 6,
                          engine_id=f"engine-{i % 6}", prompt_tokens=120_000 + i, output_tokens=350,
                          cached_tokens=119_000, latency_s=2.5) for i in range(n)]
    return [Observation(t=1.7e9 + i, queued=40, running=980, roles=["train", "rollout", "rollout", "train"] * 2,
                        sessions=[0, 250, 240, 0, 0, 260, 230, 0]) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=20000, help="events per round and kind")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None, help="run directory to write into (default: a temporary one)")
    args = ap.parse_args()
    out: dict[str, float | bool] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as run_dir:
        log = EventLog(run_dir, MetricsConfig())
        noop = NoopLog()
        print(f"{'event':<14} {'emit us':>9} {'no-op us':>9} {'overhead us':>12}   ({args.rounds} rounds x {args.events})")
        for kind in ("model_call", "observation"):
            events = make_events(kind, args.events)
            emit_us, noop_us = [], []
            for _ in range(args.rounds):
                emit_us.append(per_event_us(log, events))
                noop_us.append(per_event_us(noop, events))
            e, n = statistics.median(emit_us), statistics.median(noop_us)
            out |= {f"{kind}_emit_us": round(e, 2), f"{kind}_noop_us": round(n, 3), f"{kind}_overhead_us": round(e - n, 2)}
            print(f"{kind:<14} {e:>9.2f} {n:>9.3f} {e - n:>12.2f}")
        file_mb = os.path.getsize(log.path) / 1e6
        log.close()
        assert log.num_dropped == 0, "the benchmark's own writes failed"
    out |= {"file_mb": round(file_mb, 1), "budget_us": BUDGET_US,
            "within_budget": all(v <= BUDGET_US for k, v in out.items() if k.endswith("_overhead_us"))}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
