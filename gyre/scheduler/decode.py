"""Live decode measurement (pure): the proxy's per-engine counters -> what the policy compares.

    /admin/metrics engines[] ─(every tick)─> DecodeMeter.update(now, engines) ─> per engine over the
        trailing window: tokens, call-seconds (calls in flight x time), busy seconds
        ├─ session_tok_s: the best per-call speed seen (tokens / call-second): one session at full speed
        ├─ demand: mean calls in flight x session_tok_s, summed       -> Observation.gen_demand_tok_s
        └─ capacity: an engine whose calls ran slower than full speed delivered its cap
                     (tokens / busy second); one never seen slowed gets the mean of the measured
                     caps, or with none its sessions at full speed  -> CellView.gen_tok_s

This inverts the simulator's engine model (gyre.sim.kv.CellEngine: each of n calls runs at
min(session_tok_s, gen_tok_s / n), demand = sessions in a call x session_tok_s), so the live policy
and the simulator read the decode terms the same way. Session capacity per engine: its KV tokens
over its sessions' mean context (what its memory keeps without re-prefill), within the configured
sessions per cell.
"""

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MIN_CALL_S = 0.5
"""Call-seconds a window needs before its per-call speed counts: less is one call's timing noise."""
SLOWED = 0.8
"""Calls at under this fraction of full speed were sharing the engine's compute (its cap binds)."""


@dataclass(frozen=True)
class EngineLoads:
    """Per cell (index order), what make_observation takes; gen_tok_s None: nothing measured yet."""

    sessions: list[int]
    max_sessions: list[int]
    gen_tok_s: list[float] | None
    gen_demand_tok_s: float


def session_capacity(sessions_per_cell: int, engine: Mapping) -> int:
    """Sessions an engine keeps: its KV tokens over its sessions' mean context, within
    `sessions_per_cell` (no KV capacity reported or no context yet: `sessions_per_cell`)."""
    kv, context, n = engine.get("kv_capacity_tokens", 0), engine.get("context_tokens", 0), engine.get("num_sessions", 0)
    if not kv or not context or not n:
        return sessions_per_cell
    return max(1, min(sessions_per_cell, kv * n // context))


class DecodeMeter:
    """Decode speed, demand and capacity per engine from cumulative counters over `window_s`."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.session_tok_s = 0.0
        """One call's full decode speed, tokens/s (the best per-call speed any window showed)."""
        self.cap_tok_s: dict[str, float] = {}
        """engine -> the best rate it delivered while busy in a window its calls were slowed."""
        self._samples: deque[tuple[float, dict[str, tuple[float, float, float]]]] = deque()

    def update(self, now: float, engines: Sequence[Mapping]) -> dict[str, float]:
        """Add a sample of `engines` (/admin/metrics' list); returns each engine's mean calls in
        flight over the window (engines with no earlier sample, or whose counters restarted, omitted)."""
        sample = {e["engine_id"]: (e["output_tokens"], e["call_s"], e["busy_s"]) for e in engines}
        self._samples.append((now, sample))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()
        t0, first = self._samples[0]
        deltas = {
            eid: (tok - first[eid][0], call - first[eid][1], busy - first[eid][2])
            for eid, (tok, call, busy) in sample.items()
            if eid in first and tok >= first[eid][0] and call >= first[eid][1]
        }
        for tok, call, _ in deltas.values():
            if call >= MIN_CALL_S:
                self.session_tok_s = max(self.session_tok_s, tok / call)
        for eid, (tok, call, busy) in deltas.items():  # no token at all: prefill or a stall, not decode
            if call >= MIN_CALL_S and busy > 0 and 0 < tok < SLOWED * self.session_tok_s * call:
                self.cap_tok_s[eid] = max(self.cap_tok_s.get(eid, 0.0), tok / busy)
        dt = now - t0
        return {eid: d[1] / dt for eid, d in deltas.items()} if dt > 0 else {}

    def capacity(self, engine_id: str, max_sessions: int) -> float:
        """Decode tokens/s the engine sustains: its measured cap; else the mean of the other
        engines' (cells are alike; a cell that has not served yet, or never slowed, gets theirs);
        else its sessions at full speed."""
        if engine_id in self.cap_tok_s:
            return self.cap_tok_s[engine_id]
        if self.cap_tok_s:
            return sum(self.cap_tok_s.values()) / len(self.cap_tok_s)
        return max_sessions * self.session_tok_s


def measure_cells(
    now: float,
    engine_ids: Sequence[Sequence[str]],
    engines: Sequence[Mapping],
    meter: DecodeMeter,
    sessions_per_cell: int,
) -> EngineLoads:
    """Each cell's sessions, session capacity and decode capacity (its engines' summed; its sessions
    within `sessions_per_cell`), and the decode demand, from the proxy's `engines` (/admin/metrics)
    and each cell's engine ids (index order)."""
    by_id = {e["engine_id"]: e for e in engines}
    calls = meter.update(now, engines)
    cells = [[by_id.get(eid, {}) for eid in ids] for ids in engine_ids]
    per_engine = [[session_capacity(sessions_per_cell, e) for e in cell] for cell in cells]
    max_sessions = [min(sessions_per_cell, sum(m)) for m in per_engine]
    if not meter.session_tok_s:
        gen_tok_s, demand = None, 0.0
    else:
        gen_tok_s = [sum(map(meter.capacity, ids, m)) for ids, m in zip(engine_ids, per_engine)]
        demand = sum(calls.values()) * meter.session_tok_s
    sessions = [sum(e.get("num_sessions", 0) for e in cell) for cell in cells]
    return EngineLoads(sessions, max_sessions, gen_tok_s, demand)
