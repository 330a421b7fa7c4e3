"""The routing table (pure): which engine serves a session's next call, and the calls in flight.

Sessions (one agent of one execution) stick to an engine, so its prefix cache keeps their KV; a
session moves when its engine stops being active (drained, crashed, removed) or when its engine
carries `max_imbalance` more calls in flight than the least-loaded one. New sessions go to the
least-loaded active engine. A `closing` engine (its cell is leaving rollout: phase 1, admission
stopped) takes no new sessions but keeps serving the ones it has; `draining` (phase 2) hands them
all off (`reassign`). A returning engine takes sessions from the most loaded (`rebalance`).

The table is the one record of calls in flight: each attempt of a call on an engine is a `Flight`
from `begin` to `end`; it is `streaming` while the engine generates for it (what a drain aborts and
what balances load) and, after an abort, stays until its KV has left that engine (what a hand-off
waits for). No clocks, no sockets: the proxy's engine pool changes it.
"""

from dataclasses import dataclass, field

from gyre.errors import GyreError

STATUSES = ("active", "closing", "draining", "dead")
SERVING = ("active", "closing")
"""Statuses whose engine still serves the sessions routed to it."""


class RoutingError(GyreError):
    """An admin change the table refuses (unknown engine, bad status); lists the valid values."""


@dataclass
class Flight:
    """One attempt of one call on one engine."""

    rid: str
    engine_id: str
    session: str
    streaming: bool = True


@dataclass
class EngineEntry:
    engine_id: str
    url: str
    status: str = "active"
    supports_kv_export: bool = False
    """Builtin engines export/import KV prefixes (migration on hand-off and reroute)."""
    cell_id: str = ""
    """The cell the engine belongs to (recorded with each call it serves)."""
    flights: dict[str, Flight] = field(default_factory=dict)
    """rid -> this engine's calls in flight (streaming, or leaving it with their KV)."""

    @property
    def num_inflight(self) -> int:
        """Calls the engine is generating for."""
        return sum(f.streaming for f in self.flights.values())


class RoutingTable:
    def __init__(self, max_imbalance: int = 4):
        self.max_imbalance = max_imbalance
        self.engines: dict[str, EngineEntry] = {}
        self.sessions: dict[str, str] = {}
        self.flights: dict[str, Flight] = {}

    def add(self, engine_id: str, url: str, supports_kv_export: bool = False, cell_id: str = "") -> EngineEntry:
        """Register (or re-register, reviving it) an engine."""
        entry = self.engines.get(engine_id)
        if entry is None:
            entry = self.engines[engine_id] = EngineEntry(engine_id, url)
        entry.url, entry.status, entry.supports_kv_export, entry.cell_id = url, "active", supports_kv_export, cell_id
        return entry

    def get(self, engine_id: str) -> EngineEntry:
        if engine_id not in self.engines:
            raise RoutingError(f"unknown engine {engine_id!r}; registered: {sorted(self.engines) or 'none'}")
        return self.engines[engine_id]

    def remove(self, engine_id: str) -> None:
        for rid in self.get(engine_id).flights:
            del self.flights[rid]
        del self.engines[engine_id]
        self.sessions = {s: e for s, e in self.sessions.items() if e != engine_id}

    def set_status(self, engine_id: str, status: str) -> None:
        if status not in STATUSES:
            raise RoutingError(f"unknown status {status!r}; valid: {', '.join(STATUSES)}")
        self.get(engine_id).status = status

    def active(self) -> list[EngineEntry]:
        return [e for e in self.engines.values() if e.status == "active"]

    def pick(self, session: str, exclude: frozenset[str] = frozenset()) -> str | None:
        """The engine for `session`'s next call (sticky, balanced), or None if none serves it.

        A session stays on its engine (active or closing) unless that carries `max_imbalance` more
        calls in flight than the least-loaded active one; a closing engine with no active one left
        keeps its own sessions."""
        current = self.engines.get(self.sessions.get(session, ""))
        stays = current is not None and current.status in SERVING and current.engine_id not in exclude
        candidates = [e for e in self.active() if e.engine_id not in exclude]
        if not candidates:
            return current.engine_id if stays else None
        least = min(candidates, key=lambda e: (e.num_inflight, e.engine_id))
        if stays and current.num_inflight <= least.num_inflight + self.max_imbalance:
            return current.engine_id
        self.sessions[session] = least.engine_id
        return least.engine_id

    def reassign(self, engine_id: str) -> dict[str, str]:
        """Move every session of `engine_id` to an active engine, each to the one with the fewest
        sessions (ties: fewest calls in flight, then id); returns {session: new engine}. With no
        active engine left the sessions stay (their next call waits for one)."""
        others = [e.engine_id for e in self.active() if e.engine_id != engine_id]
        if not others:
            return {}
        counts, busy = self.num_sessions(), {e: self.engines[e].num_inflight for e in others}
        moves = {}
        for s in sorted(s for s, e in self.sessions.items() if e == engine_id):
            dst = min(others, key=lambda e: (counts[e], busy[e], e))
            counts[dst] += 1
            self.sessions[s] = moves[s] = dst
        return moves

    def rebalance(self, engine_id: str) -> dict[str, str]:
        """Move idle sessions (no call in flight) from the most loaded engines onto `engine_id` until
        every engine's sessions are within one of its; returns {session: engine it leaves}."""
        counts, moves = self.num_sessions(), {}
        busy = {f.session for f in self.flights.values()}
        idle: dict[str, list[str]] = {}
        for s, e in sorted(self.sessions.items()):
            if s not in busy and e != engine_id and self.engines[e].status in SERVING:
                idle.setdefault(e, []).append(s)
        while idle:
            src = max(idle, key=lambda e: (counts[e], e))
            if counts[src] - counts[engine_id] <= 1:
                break
            s = idle[src].pop()
            if not idle[src]:
                del idle[src]
            counts[src] -= 1
            counts[engine_id] += 1
            self.sessions[s], moves[s] = engine_id, src
        return moves

    def num_sessions(self) -> dict[str, int]:
        """Engine id -> sessions routed to it (every engine listed; one pass over the sessions)."""
        counts = dict.fromkeys(self.engines, 0)
        for eid in self.sessions.values():
            if eid in counts:
                counts[eid] += 1
        return counts

    def executions_with_sessions(self) -> set[str]:
        """Ids of executions with a session in the table (keys are `<execution id>/<agent id>`;
        sessions leave when their execution is revoked or their engine removed)."""
        return {s.split("/", 1)[0] for s in self.sessions}

    def begin(self, rid: str, engine_id: str, session: str) -> Flight:
        """A call's attempt starts streaming from `engine_id`."""
        flight = Flight(rid, engine_id, session)
        self.get(engine_id).flights[rid] = self.flights[rid] = flight
        return flight

    def stop_streaming(self, rid: str) -> None:
        """The engine is done with the attempt (its KV may still have to leave)."""
        if rid in self.flights:
            self.flights[rid].streaming = False

    def end(self, rid: str) -> None:
        """The attempt is over: finished, or its KV has left its engine (or was given up)."""
        flight = self.flights.pop(rid, None)
        if flight is not None and flight.engine_id in self.engines:
            self.engines[flight.engine_id].flights.pop(rid, None)

    def streaming(self, engine_id: str) -> list[str]:
        """Rids of the calls `engine_id` is generating for (what a drain aborts)."""
        return [f.rid for f in self.get(engine_id).flights.values() if f.streaming]

    def busy_sessions(self, engine_id: str) -> set[str]:
        """Sessions with a call in flight on `engine_id` (their call moves its own KV)."""
        return {f.session for f in self.get(engine_id).flights.values()}

    def forget(self, session_prefix: str) -> list[str]:
        """Drop the sessions of a finished execution (keys start with its id); returns them."""
        gone = [s for s in self.sessions if s.startswith(session_prefix)]
        for s in gone:
            del self.sessions[s]
        return gone
