"""The proxy's engine pool: a client per engine, health checks, and the verbs that move sessions.

    admin ─register / stop_admission / hand_off / activate / remove─> pool ─> RoutingTable (pure)
    hand_off(A): A draining ─> table.reassign(A): each session gets a new engine
                 ├─ one batched move per new engine B: idle sessions' KV and the prompt pages of ─┐
                 │  calls in flight, all in one export / import / Mooncake batch read (A -> B)      │
                 └─ calls in flight: aborted meanwhile; each resumes on B and moves only the      ┤
                    tail it decoded on A (generation -> move_kv, kv_from = the prompt moved)      │
                 return once A has no call in flight and no move under way, or kv_move_timeout_s <┘
                 (only then may A's cell release the engine's memory)
    activate(B): B active ─> table.rebalance(B) ─> one batched move per (most loaded engine, B)

A session's next call waits for its move, so it finds its KV on its new engine (cached_tokens). KV
that cannot move (target full, timeout, engine dead) is recomputed by the session's next call and
counted in `kv_reprefill_tokens`; so is the KV of a session that `acquire` routes off its engine
between calls without a move (its engine marked dead, or `max_imbalance` more calls on it than on
the least loaded): what its next call finds cached (`count_cached`) is not counted. Everything
else (Generation, the HTTP edge) changes the pool's state only through these verbs.
"""

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
import numpy as np

from gyre.engines.client import EngineClient, EngineHTTPError, migrate_prefixes
from gyre.proxy.chat import ApiError
from gyre.proxy.config import ProxyConfig
from gyre.proxy.routing import SERVING, RoutingTable

log = logging.getLogger(__name__)
ENGINE_DOWN = (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError)
MOVES_PER_ENGINE = 4
"""Batched KV moves out of one engine at once: under the builtin engine's MAX_EXPORTS (8)
published exports, so none is withdrawn before its reader has it."""


@dataclass
class DecodeCounters:
    """One engine's decode counters since the proxy started (cumulative; the coordinator takes
    differences over a window, gyre.scheduler.decode)."""

    output_tokens: int = 0
    """Output tokens the engine generated for the proxy's calls."""
    call_s: float = 0.0
    """Call-seconds: the time integral of its calls in flight (streaming)."""
    busy_s: float = 0.0
    """Seconds with at least one call in flight."""
    num_streaming: int = 0
    since: float = 0.0
    """When `call_s` and `busy_s` were last brought up to date (time.monotonic)."""

    def advance(self, now: float) -> None:
        dt = now - self.since if self.num_streaming else 0.0
        self.call_s += self.num_streaming * dt
        self.busy_s += dt
        self.since = now

    def add_streaming(self, delta: int, now: float) -> None:
        self.advance(now)
        self.num_streaming += delta


@dataclass
class PoolMetrics:
    num_calls: int = 0
    num_reroutes: int = 0
    num_engine_failures: int = 0
    num_overloaded: int = 0
    num_sessions_moved: int = 0
    """Sessions between calls given a new engine with their KV (hand-off, rebalance)."""
    kv_migrated_tokens: int = 0
    """KV tokens moved between engines (sessions between calls and calls in flight)."""
    kv_reprefill_tokens: int = 0
    """KV tokens a leaving engine held (or is assumed to have held: it is dead) that did not reach
    the session's new engine, and those of sessions routed off a dead or overloaded engine between
    calls that their new engine did not have cached; their next call recomputes them."""
    kv_reprefill_rerouted_tokens: int = 0
    """Of kv_reprefill_tokens, those of sessions routed off a dead or overloaded engine between calls
    (the rest: KV a hand-off or a call's own move could not carry)."""


class EnginePool:
    def __init__(self, cfg: ProxyConfig):
        self.cfg = cfg
        self.table = RoutingTable(cfg.max_imbalance)
        self.clients: dict[str, EngineClient] = {}
        self.metrics = PoolMetrics()
        self._page_size: dict[str, int] = {}
        self._contexts: dict[str, tuple[np.ndarray, list[int]]] = {}
        """session -> (input ids, output ids) of its last finished call: the KV its engine holds."""
        self._moves: dict[str, tuple[str, asyncio.Task]] = {}
        """session -> (engine it leaves, the task moving its KV: one per (source, destination))."""
        self._prompts: dict[str, tuple[np.ndarray, list[int]]] = {}
        """rid of a call attempt -> its prompt (input ids, output ids before it): the KV its engine
        cached at prefill, which a hand-off moves before the attempt's abort completes."""
        self._premoved: dict[str, tuple[str, str, int]] = {}
        """session -> (source, destination, tokens) of an aborted call's prompt KV moved already."""
        self._rerouted: dict[str, int] = {}
        """session -> KV tokens the engine it was routed off between calls held (dead engine,
        imbalance): its next call's `cached_tokens` says how many of them it need not recompute."""
        self._through_store: dict[str, int] = {}
        """session -> KV tokens its SGLang engine held when the session left it: HiCache's shared
        store moves them, and the session's next call says how many arrived (`cached_tokens`)."""
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._decode: dict[str, DecodeCounters] = {}
        self._kv_tokens: dict[str, int] = {}
        """engine -> KV tokens its memory holds, where it says (builtin: max_total_num_tokens)."""
        self._changed = asyncio.Event()
        """Set (and replaced) whenever engines, flights or moves change: what waiters wait on."""
        self._health_task: asyncio.Task | None = None

    async def start(self) -> None:
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task:
            self._health_task.cancel()
        for _, task in list(self._moves.values()):
            task.cancel()
        for c in self.clients.values():
            await c.close()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), max(timeout_s, 0))
        except TimeoutError:
            pass

    # --- admin ------------------------------------------------------------------------------
    async def register(self, engine_id: str, url: str, cell_id: str = "") -> dict:
        """Add an engine after one /model_info answer (which also says whether it exports KV)."""
        client = EngineClient(url, timeout_s=self.cfg.request_timeout_s)
        await client.__aenter__()
        try:
            info = await asyncio.wait_for(client.model_info(), 10)
        except (*ENGINE_DOWN, EngineHTTPError, ValueError) as e:
            await client.close()
            raise ApiError(
                "invalid_request", f"engine {engine_id} at {url} did not answer /model_info: {e!r}"
            ) from None
        builtin = info.get("engine") == "gyre-builtin"
        client.key_by_weight_version = not builtin  # SGLang: HiCache keys KV by extra_key = weight version
        old = self.clients.pop(engine_id, None)
        if old:
            await old.close()
        self.clients[engine_id] = client
        self._page_size[engine_id] = int(info.get("page_size", 1))
        if info.get("max_total_num_tokens"):
            self._kv_tokens[engine_id] = int(info["max_total_num_tokens"])
        self._decode.setdefault(engine_id, DecodeCounters(since=time.monotonic()))
        self._slots.setdefault(engine_id, asyncio.Semaphore(MOVES_PER_ENGINE))
        self.table.add(engine_id, url, supports_kv_export=builtin, cell_id=cell_id)
        self._wake()
        return {"engine_id": engine_id, "url": url, "weight_version": client.weight_version}

    async def stop_admission(self, engine_id: str) -> None:
        """Phase 1 of a cell leaving rollout: no new sessions; its current ones stay (see routing)."""
        self.table.set_status(engine_id, "closing")
        self._wake()

    async def hand_off(self, engine_id: str) -> dict:
        """Phase 2 of a cell leaving rollout: every session of the engine, in flight or between
        calls, gets a new engine and its KV moves there. Returns once every move has finished or
        been given up, so the engine's memory may be released after it."""
        self.table.set_status(engine_id, "draining")
        moves, busy = self.table.reassign(engine_id), self.table.busy_sessions(engine_id)
        # The aborts wait for the engine's current step to end; the idle sessions' exports do not
        # (they run beside the engine thread), so they start at once instead of after that step.
        abort = asyncio.create_task(self._abort_streaming(engine_id))
        prompts = self._streaming_prompts(engine_id)
        self._start_moves(  # a call in flight without a known prompt moves its own KV after its abort
            [(s, engine_id, dst, prompts.get(s)) for s, dst in moves.items() if s not in busy or s in prompts]
        )
        self._count_stranded(engine_id, busy)
        aborted = await abort
        self._wake()
        deadline = time.monotonic() + self.cfg.kv_move_timeout_s
        while self._holds(engine_id) and time.monotonic() < deadline:
            await self._wait_change(0.5)
            await self._abort_streaming(engine_id)  # a call may have reached the engine after the first abort
        if self._holds(engine_id):
            log.warning("hand-off of %s: moves still under way after %g s", engine_id, self.cfg.kv_move_timeout_s)
        return {"num_aborted": aborted, "num_sessions": len(moves)}

    def _count_stranded(self, engine_id: str, busy: set[str]) -> None:
        """Idle sessions left on a leaving engine (no other engine is active to take them) lose
        their KV with its memory: their next call, wherever it runs, recomputes it (counted here)."""
        ps = self._page_size.get(engine_id, 1)
        for session, eid in self.table.sessions.items():
            context = self._contexts.get(session)
            if eid == engine_id and session not in busy and context is not None:
                self.metrics.kv_reprefill_tokens += (len(context[0]) + len(context[1])) // ps * ps

    def _holds(self, engine_id: str) -> bool:
        """Whether a call or a session move still needs the engine's KV."""
        entry = self.table.engines.get(engine_id)
        return bool(entry and entry.flights) or any(src == engine_id for src, _ in self._moves.values())

    def _streaming_prompts(self, engine_id: str) -> dict[str, np.ndarray]:
        """session -> the prompt of its call streaming from `engine_id` (whose KV the engine cached)."""
        out = {}
        for rid, flight in self.table.engines[engine_id].flights.items():
            prompt = self._prompts.get(rid)
            if flight.streaming and prompt is not None:
                out[flight.session] = np.concatenate((prompt[0], np.asarray(prompt[1], np.int32)))
        return out

    async def _abort_streaming(self, engine_id: str) -> int:
        rids = self.table.streaming(engine_id)
        client = self.clients[engine_id]
        await asyncio.gather(*(client.abort(rid) for rid in rids), return_exceptions=True)
        return len(rids)

    async def set_weight_version(self, engine_id: str, version: int | None, loading: bool = False) -> None:
        """`loading`: a load is starting, the engine's calls wait until it ends. Otherwise the load
        ended: `version` is what `engine_id` serves now (SGLang calls' `extra_key` from here on),
        None: it failed and the engine serves what it served before; either way its calls go on."""
        self.table.get(engine_id)  # RoutingError (404) for an unknown engine
        client = self.clients[engine_id]
        if loading:
            client.hold_calls()
        else:
            client.serve_version(client.weight_version if version is None else version)

    async def activate(self, engine_id: str) -> dict:
        """The engine serves (again); with `rebalance_on_return`, idle sessions of the most loaded
        engines move to it with their KV until loads are even within one session."""
        self.table.set_status(engine_id, "active")
        moves = self.table.rebalance(engine_id) if self.cfg.rebalance_on_return else {}
        self._start_moves([(session, src, engine_id, None) for session, src in moves.items()])
        self._wake()
        return {"num_sessions": len(moves)}

    async def remove(self, engine_id: str) -> None:
        await self.hand_off(engine_id)
        self.table.remove(engine_id)
        self._decode.pop(engine_id, None)  # its calls left with it (a re-registered engine counts anew)
        client = self.clients.pop(engine_id, None)
        if client:
            await client.close()

    def forget(self, execution_id: str) -> None:
        """An execution ended: drop its sessions and their contexts."""
        for session in self.table.forget(execution_id + "/"):
            self._contexts.pop(session, None)
            self._premoved.pop(session, None)
            self._rerouted.pop(session, None)

    def describe(self) -> list[dict]:
        """Each engine's state and load: calls in flight, sessions routed to it and the KV tokens
        of their last calls, its decode counters (DecodeCounters) and KV capacity (0: unknown)."""
        sessions, context = self.table.num_sessions(), dict.fromkeys(self.table.engines, 0)
        for session, (input_ids, output_ids) in self._contexts.items():
            eid = self.table.sessions.get(session)
            if eid in context:
                context[eid] += len(input_ids) + len(output_ids)
        now = time.monotonic()
        out = []
        for e in self.table.engines.values():
            counters = self._decode[e.engine_id]
            counters.advance(now)
            client = self.clients.get(e.engine_id)
            out.append(
                {
                    "engine_id": e.engine_id,
                    "url": e.url,
                    "status": e.status,
                    "num_inflight": e.num_inflight,
                    "num_sessions": sessions[e.engine_id],
                    "context_tokens": context[e.engine_id],
                    "kv_capacity_tokens": self._kv_tokens.get(e.engine_id, 0),
                    "output_tokens": counters.output_tokens,
                    "call_s": counters.call_s,
                    "busy_s": counters.busy_s,
                    "supports_kv_export": e.supports_kv_export,
                    "cell_id": e.cell_id,
                    "weight_version": client.weight_version if client else None,
                }
            )
        return out

    def executions_with_sessions(self) -> set[str]:
        return self.table.executions_with_sessions()

    def cell_of(self, engine_id: str) -> str:
        entry = self.table.engines.get(engine_id)
        return entry.cell_id if entry else ""

    # --- health -----------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            for eid, entry in list(self.table.engines.items()):
                client = self.clients.get(eid)
                if client is None or entry.status == "draining":
                    continue
                try:
                    ok = await asyncio.wait_for(client.health(), self.cfg.health_interval_s * 5)
                except TimeoutError:
                    ok = False
                if not ok and entry.status in SERVING:
                    self.mark_dead(eid, "health check failed")
                elif ok and entry.status == "dead":
                    log.warning("engine %s answers /health again: active", eid)
                    self.table.set_status(eid, "active")
                    self._wake()

    def mark_dead(self, engine_id: str, why: str) -> None:
        entry = self.table.engines.get(engine_id)
        if entry is not None and entry.status in SERVING:
            log.warning("engine %s marked dead: %s", engine_id, why)
            self.table.set_status(engine_id, "dead")
            self.metrics.num_engine_failures += 1

    # --- calls ------------------------------------------------------------------------------
    async def acquire(self, session: str, exclude: frozenset[str]) -> str:
        """An engine for the session's next call, after its KV move if one is under way; waits
        (bounded) while no engine is active."""
        move = self._moves.get(session)
        if move is not None:
            await asyncio.shield(move[1])  # bounded by kv_move_timeout_s
        deadline = time.monotonic() + self.cfg.no_engine_wait_s
        while True:
            before = self.table.sessions.get(session)
            eid = self.table.pick(session, exclude) or self.table.pick(session)
            if eid is not None:
                if before is not None and eid != before and before not in exclude:
                    self._note_rerouted(session, before)
                return eid
            left = deadline - time.monotonic()
            if left <= 0:
                self.metrics.num_overloaded += 1
                raise ApiError("overloaded", f"no engine available for {self.cfg.no_engine_wait_s:g} s; retry later")
            await self._wait_change(left)

    def _note_rerouted(self, session: str, src: str) -> None:
        """The session left `src` between calls with no KV move (src dead, or more loaded than
        max_imbalance allows): what src held of its last call is re-prefilled by its next call,
        less what that call finds cached (count_cached). A draining src is the hand-off's, which
        moves or counts its sessions itself; a call rerouted mid-way (src excluded) moves its own."""
        entry, context = self.table.engines.get(src), self._contexts.get(session)
        if entry is None or context is None or entry.status == "draining":
            return
        ps = self._page_size.get(src, 1)
        self._rerouted[session] = (len(context[0]) + len(context[1])) // ps * ps

    def begin(self, rid: str, engine_id: str, session: str, prompt: tuple[np.ndarray, list[int]] | None = None) -> None:
        """A call's attempt starts streaming from the engine; `prompt`: its (input ids, output ids
        so far), whose KV a hand-off moves while the attempt is aborted."""
        self.table.begin(rid, engine_id, session)
        if prompt is not None:
            self._prompts[rid] = prompt
        self._decode[engine_id].add_streaming(1, time.monotonic())

    def count_output(self, engine_id: str, num_tokens: int) -> None:
        counters = self._decode.get(engine_id)  # None: the engine was removed meanwhile
        if counters is not None:
            counters.output_tokens += num_tokens

    def stop_streaming(self, rid: str) -> None:
        flight = self.table.flights.get(rid)
        if flight is not None and flight.streaming:
            self._decode[flight.engine_id].add_streaming(-1, time.monotonic())
        self.table.stop_streaming(rid)

    def end(self, rid: str) -> None:
        """The attempt is over and its KV needs its engine no more (a hand-off may be waiting)."""
        self.stop_streaming(rid)
        self.table.end(rid)
        self._prompts.pop(rid, None)
        self._wake()

    def count_call(self) -> None:
        self.metrics.num_calls += 1

    def count_reroute(self) -> None:
        self.metrics.num_reroutes += 1

    def remember(self, session: str, input_ids: np.ndarray, output_ids: list[int]) -> None:
        """The session's last finished call: the context whose KV moves with the session."""
        self._contexts[session] = (input_ids, output_ids)

    # --- KV moves ---------------------------------------------------------------------------
    def _start_moves(self, moves: list[tuple[str, str, str, np.ndarray | None]]) -> None:
        """Start one batched move per (source, destination) pair. Each move: (session, source,
        destination, the prompt of its call in flight on the source, or None: the session is
        between calls and its last context moves)."""
        pairs: dict[tuple[str, str], list[tuple[str, np.ndarray, bool]]] = {}
        for session, src, dst, prompt in moves:
            context, entry = self._contexts.get(session), self.table.engines.get(src)
            if entry is None or (context is None and prompt is None):
                continue
            if not entry.supports_kv_export:
                if prompt is None:  # SGLang: no KV route; HiCache's store (L3) holds the pages written
                    # through, all but the last token's (never computed), and the next call reads them
                    ps = self._page_size.get(src, 1)
                    self._through_store[session] = (len(context[0]) + len(context[1]) - 1) // ps * ps
            elif session not in self._moves:
                if prompt is None:
                    prompt = np.concatenate((context[0], np.asarray(context[1], np.int32)))
                    pairs.setdefault((src, dst), []).append((session, prompt, False))
                else:
                    pairs.setdefault((src, dst), []).append((session, prompt, True))
        for (src, dst), group in pairs.items():
            task = asyncio.create_task(self._move_group(src, dst, group))
            for session, _, _ in group:
                self._moves[session] = (src, task)

    async def _move_group(self, src: str, dst: str, group: list[tuple[str, np.ndarray, bool]]) -> None:
        """Move sessions' KV from `src` to `dst` in one batch: (session, tokens, whether it is the
        prompt of a call in flight, whose decoded tail its generation moves after the abort). A
        session routed elsewhere meanwhile (its new engine left too) follows from `dst`."""
        task = asyncio.current_task()
        follow = []
        try:
            results = await self._migrate(src, dst, [(tokens, 0) for _, tokens, _ in group])
            for (session, tokens, in_flight), (held, moved) in zip(group, results):
                self.metrics.kv_migrated_tokens += moved
                if in_flight:  # what did not arrive, the generation's own move retries (and counts)
                    if moved:
                        self._premoved[session] = (src, dst, moved)
                    continue
                self.metrics.kv_reprefill_tokens += held - moved
                self.metrics.num_sessions_moved += 1
                now = self.table.sessions.get(session)
                if now is not None and now != dst:
                    follow.append((session, tokens, now))
        finally:
            for session, _, _ in group:
                if self._moves.get(session, (None, task))[1] is task:
                    del self._moves[session]
            for session, tokens, now in follow:
                self._contexts.setdefault(session, (np.asarray(tokens, np.int32), []))
                self._start_moves([(session, dst, now, None)])
            self._wake()

    def count_cached(self, session: str, cached_tokens: int) -> None:
        """The first answer of a session's call reports `cached_tokens`: after a hand-off through
        HiCache's store, those of the KV the session left behind arrived, the rest is recomputed;
        after a reroute between calls (_note_rerouted), the rest is recomputed."""
        held = self._through_store.pop(session, None)
        if held is not None:
            moved = min(cached_tokens, held)
            self.metrics.kv_migrated_tokens += moved
            self.metrics.kv_reprefill_tokens += held - moved
        rerouted = self._rerouted.pop(session, None)
        if rerouted is not None:  # what the new engine had cached already was not moved, nor recomputed
            recomputed = rerouted - min(cached_tokens, rerouted)
            self.metrics.kv_reprefill_tokens += recomputed
            self.metrics.kv_reprefill_rerouted_tokens += recomputed

    async def move_kv(self, src: str, dst: str, tokens: np.ndarray, session: str | None = None) -> int:
        """Move the KV `src` holds for a prefix of `tokens` to `dst` over Mooncake (builtin engines),
        within kv_move_timeout_s; what does not arrive is counted as re-prefill. Where a hand-off
        moved the `session`'s prompt from `src` to `dst` already, only the rest moves. Returns the
        tokens of `tokens` whose KV reached `dst` by moving."""
        done = self._premoved.pop(session, None) if session is not None else None
        kv_from = done[2] if done is not None and done[:2] == (src, dst) else 0
        [(held, moved)] = await self._migrate(src, dst, [(tokens, kv_from)])
        self.metrics.kv_migrated_tokens += moved
        self.metrics.kv_reprefill_tokens += held - moved
        return kv_from + moved

    async def _migrate(self, src: str, dst: str, asks: list[tuple[np.ndarray, int]]) -> list[tuple[int, int]]:
        """One batched move (migrate_prefixes) of asks (tokens, kv_from); per ask (tokens `src`
        held beyond kv_from, tokens moved). A move that cannot run or fails holds what `src` is
        assumed to hold and moves nothing."""
        s, d = self.table.engines.get(src), self.table.engines.get(dst)
        if s is None or d is None or src == dst or not s.supports_kv_export:
            return [(0, 0)] * len(asks)  # SGLang engines share KV through HiCache's Mooncake store instead
        ps = self._page_size.get(src, 1)
        lost = [(max(0, len(tokens) // ps * ps - kv_from), 0) for tokens, kv_from in asks]
        # No full page beyond kv_from (a call in flight whose prompt moved and that decoded less than
        # a page since): nothing can move, and a round trip would walk its whole chain on `src`.
        if not any(held for held, _ in lost):
            return lost
        if not (self.cfg.migrate_kv and d.supports_kv_export and s.status != "dead"):
            return lost
        try:
            async with asyncio.timeout(self.cfg.kv_move_timeout_s), self._slots[src]:
                out = await migrate_prefixes(self.clients[src], self.clients[dst], asks)
        except (*ENGINE_DOWN, EngineHTTPError, KeyError) as e:
            log.warning("KV move %s -> %s failed (recomputing): %r", src, dst, e)
            return lost
        for o in out:
            if o["refused"]:
                log.warning("KV move %s -> %s refused (recomputing): %s", src, dst, o["refused"])
        return [(o["exported_tokens"], o["transferred_tokens"]) for o in out]
