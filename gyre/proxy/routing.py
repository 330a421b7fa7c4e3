"""The routing table (pure): which engine serves a session's next call.

Sessions (one agent of one execution) stick to an engine, so its prefix cache keeps their KV; a
session moves when its engine stops being active (drained, crashed, removed) or when its engine
carries `max_imbalance` more calls in flight than the least-loaded one. New sessions go to the
least-loaded active engine. A `closing` engine (its cell is leaving rollout: phase 1, admission
stopped) takes no new sessions but keeps serving the ones it has; `draining` (phase 2) aborts and
moves them too. No clocks, no sockets: the proxy's edge updates it as calls start and end and as
the admin API or health checks change an engine's status.
"""

from dataclasses import dataclass

from gyre.errors import GyreError

STATUSES = ("active", "closing", "draining", "dead")
SERVING = ("active", "closing")
"""Statuses whose engine still serves the sessions routed to it."""


class RoutingError(GyreError):
    """An admin change the table refuses (unknown engine, bad status); lists the valid values."""


@dataclass
class EngineEntry:
    engine_id: str
    url: str
    status: str = "active"
    num_inflight: int = 0
    supports_kv_export: bool = False
    """Builtin engines export/import KV prefixes (migration on reroute)."""
    cell_id: str = ""
    """The cell the engine belongs to (recorded with each call it serves)."""


class RoutingTable:
    def __init__(self, max_imbalance: int = 4):
        self.max_imbalance = max_imbalance
        self.engines: dict[str, EngineEntry] = {}
        self.sessions: dict[str, str] = {}

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
        self.get(engine_id)
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

    def begin(self, engine_id: str) -> None:
        self.get(engine_id).num_inflight += 1

    def end(self, engine_id: str) -> None:
        if engine_id in self.engines:
            self.engines[engine_id].num_inflight -= 1

    def forget(self, session_prefix: str) -> None:
        """Drop the sessions of a finished execution (keys start with its id)."""
        self.sessions = {s: e for s, e in self.sessions.items() if not s.startswith(session_prefix)}
