"""The proxy's engine edge: clients per engine, health checks, drains, and generation with reroutes.

    handler ─Generation(prompt)─> pool.acquire(session) ─> engine A /generate (stream)
        ^                                   │ abort (drain) / connection lost (crash)
        └── new tokens ─────────────────────┤
                                            └─> migrate KV prefix A->B (if A alive) ─> engine B
                                                /generate(prompt + partial output, remaining budget)

A drained or crashed engine's in-flight calls resume on another engine from input + the output
tokens already produced, so the harness sees one ordinary response; the record keeps one input
and the concatenated output with its log-probs and weight versions. With no active engine a call
waits up to `no_engine_wait_s`, then fails with an overloaded error (harnesses retry those).
"""

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import orjson

from gyre.engines.client import EngineClient, EngineHTTPError, migrate_prefix, parse_weight_version
from gyre.proxy.chat import ApiError
from gyre.proxy.routing import SERVING, RoutingTable

log = logging.getLogger(__name__)
_ENGINE_DOWN = (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError)


@dataclass
class PoolMetrics:
    num_calls: int = 0
    num_reroutes: int = 0
    num_migrated_tokens: int = 0
    num_engine_failures: int = 0
    num_overloaded: int = 0


class EnginePool:
    def __init__(
        self,
        *,
        no_engine_wait_s: float,
        health_interval_s: float,
        request_timeout_s: float,
        max_imbalance: int,
        migrate_kv: bool,
    ):
        self.table = RoutingTable(max_imbalance)
        self.no_engine_wait_s, self.health_interval_s = no_engine_wait_s, health_interval_s
        self.request_timeout_s, self.migrate_kv = request_timeout_s, migrate_kv
        self.clients: dict[str, EngineClient] = {}
        self.inflight: dict[str, set[str]] = {}
        """engine id -> rids of calls streaming from it (what a drain aborts)."""
        self.metrics = PoolMetrics()
        self._changed = asyncio.Condition()
        self._health_task: asyncio.Task | None = None

    async def start(self) -> None:
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task:
            self._health_task.cancel()
        for c in self.clients.values():
            await c.close()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # --- admin ------------------------------------------------------------------------------
    async def register(self, engine_id: str, url: str, cell_id: str = "") -> dict:
        """Add an engine after one /model_info answer (which also says whether it exports KV)."""
        client = EngineClient(url, timeout_s=self.request_timeout_s)
        await client.__aenter__()
        try:
            info = await asyncio.wait_for(client.model_info(), 10)
        except (*_ENGINE_DOWN, EngineHTTPError, ValueError) as e:
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
        self.inflight.setdefault(engine_id, set())
        self.table.add(engine_id, url, supports_kv_export=builtin, cell_id=cell_id)
        await self._notify()
        return {"engine_id": engine_id, "url": url, "weight_version": client.weight_version}

    async def stop_admission(self, engine_id: str) -> None:
        """Phase 1 of a cell leaving rollout: no new sessions; its current ones stay (see routing)."""
        self.table.set_status(engine_id, "closing")
        await self._notify()

    async def drain(self, engine_id: str) -> int:
        """Stop routing to the engine and abort its in-flight calls (they resume elsewhere)."""
        self.table.set_status(engine_id, "draining")
        rids = list(self.inflight.get(engine_id, ()))
        client = self.clients[engine_id]
        await asyncio.gather(*(client.abort(rid) for rid in rids), return_exceptions=True)
        return len(rids)

    async def set_weight_version(self, engine_id: str, version: int | None) -> None:
        """`version`: what `engine_id` serves now (its owner loaded it), SGLang calls' `extra_key` from
        here on; None: a load is starting, its calls wait until the version it brings is set."""
        self.table.get(engine_id)  # RoutingError (404) for an unknown engine
        client = self.clients[engine_id]
        if version is None:
            client.hold_calls()
        else:
            client.serve_version(version)

    async def activate(self, engine_id: str) -> None:
        self.table.set_status(engine_id, "active")
        await self._notify()

    async def remove(self, engine_id: str) -> None:
        await self.drain(engine_id)
        self.table.remove(engine_id)
        client = self.clients.pop(engine_id, None)
        if client:
            await client.close()

    def describe(self) -> list[dict]:
        """Each engine's state and load: calls in flight and sessions routed to it."""
        sessions = self.table.num_sessions()
        return [
            {
                "engine_id": e.engine_id,
                "url": e.url,
                "status": e.status,
                "num_inflight": e.num_inflight,
                "num_sessions": sessions[e.engine_id],
                "supports_kv_export": e.supports_kv_export,
                "cell_id": e.cell_id,
                "weight_version": self.clients[e.engine_id].weight_version if e.engine_id in self.clients else None,
            }
            for e in self.table.engines.values()
        ]

    # --- health -----------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            for eid, entry in list(self.table.engines.items()):
                client = self.clients.get(eid)
                if client is None or entry.status == "draining":
                    continue
                try:
                    ok = await asyncio.wait_for(client.health(), self.health_interval_s * 5)
                except TimeoutError:
                    ok = False
                if not ok and entry.status in SERVING:
                    self.mark_dead(eid, "health check failed")
                elif ok and entry.status == "dead":
                    log.warning("engine %s answers /health again: active", eid)
                    entry.status = "active"
                    await self._notify()

    def mark_dead(self, engine_id: str, why: str) -> None:
        entry = self.table.engines.get(engine_id)
        if entry is not None and entry.status in SERVING:
            log.warning("engine %s marked dead: %s", engine_id, why)
            entry.status = "dead"
            self.metrics.num_engine_failures += 1

    # --- calls ------------------------------------------------------------------------------
    async def acquire(self, session: str, exclude: frozenset[str]) -> str:
        """An engine for the session, waiting (bounded) while none is active."""
        deadline = time.monotonic() + self.no_engine_wait_s
        async with self._changed:
            while True:
                eid = self.table.pick(session, exclude) or self.table.pick(session)
                if eid is not None:
                    return eid
                left = deadline - time.monotonic()
                if left <= 0:
                    self.metrics.num_overloaded += 1
                    raise ApiError("overloaded", f"no engine available for {self.no_engine_wait_s:g} s; retry later")
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    pass


async def _one(coro):
    yield await coro


@dataclass
class Generation:
    """One call's generation across engines; `stream()` yields new output ids as they arrive."""

    pool: EnginePool
    session: str
    rid: str
    input_ids: np.ndarray
    """int32 prompt ids."""
    input_json: tuple[bytes, ...]
    """The same as a JSON array in pieces (rendered incrementally: a long context costs only its new ids)."""
    sampling: dict
    max_resumes: int = 16
    incremental: bool = True
    """Stream from the engine (for streaming answers); else one /generate answer per engine attempt
    (cheaper for the engine; a drained call still returns its partial output with finish abort)."""
    on_admit: Callable[[], None] | None = None
    """Called once, when the call first gets an engine (the proxy numbers calls then)."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str = "abort"
    engine_ids: list[str] = field(default_factory=list)
    num_migrated: int = 0
    num_recomputed: int = 0
    cached_tokens: int = 0
    engine_s: float = 0.0
    """Wall time spent in engine calls (the rest of a call's time is the proxy's own or queueing)."""

    @property
    def rerouted(self) -> bool:
        return len(self.engine_ids) > 1

    async def stream(self):
        """Yield lists of new output ids until the call finishes (stop or length)."""
        budget, prev = self.sampling["max_new_tokens"], None
        for attempt in range(self.max_resumes + 1):
            eid = await self.pool.acquire(self.session, frozenset([prev]) if prev else frozenset())
            if not self.engine_ids and self.on_admit is not None:
                self.on_admit()
            self.engine_ids.append(eid)
            prompt = self._prompt_json()
            if prev is not None:
                await self._migrate(
                    prev, eid, np.concatenate((self.input_ids, np.asarray(self.output_ids, np.int32))).tolist()
                )
            params = {**self.sampling, "max_new_tokens": budget - len(self.output_ids)}
            finish = None
            async for new in self._one_engine(eid, f"{self.rid}-{attempt}", prompt, params):
                if isinstance(new, dict):
                    finish = new
                else:
                    yield new
            if finish is not None and finish.get("type") != "abort":
                self.finish = finish["type"]
                return
            if len(self.output_ids) >= budget:
                self.finish = "length"
                return
            self.pool.metrics.num_reroutes += 1
            prev = eid
        raise ApiError("api_error", f"call {self.rid} was interrupted {self.max_resumes + 1} times; giving up")

    def _prompt_json(self) -> tuple[bytes, ...]:
        """The prompt of the next engine attempt (input + output so far) as JSON array pieces."""
        if not self.output_ids:
            return self.input_json
        return (*self.input_json[:-1], b"," + orjson.dumps(self.output_ids)[1:])

    async def _one_engine(self, eid: str, rid: str, ids_json: tuple[bytes, ...], params: dict):
        """Stream from one engine; yields new-id lists, then the finish dict (None if the engine failed)."""
        pool, client = self.pool, self.pool.clients[eid]
        prompt = ()  # sent as `ids_json`
        pool.table.begin(eid)
        pool.inflight[eid].add(rid)
        seen, t0 = 0, time.monotonic()
        try:
            if self.incremental:
                chunks = client.generate_stream(prompt, params, rid=rid, return_logprob=True, input_ids_json=ids_json)
            else:
                chunks = _one(client.generate(prompt, params, rid=rid, return_logprob=True, input_ids_json=ids_json))
            async for chunk in chunks:
                ids, meta = chunk["output_ids"], chunk["meta_info"]
                new = ids[seen:]  # chunks are cumulative (SGLang's default, the builtin engine's)
                raw = meta.get("output_token_logprobs") or []
                self._extend(new, [x[0] for x in (raw[seen:] if len(raw) == len(ids) else raw)], meta, seen)
                seen += len(new)
                self.cached_tokens = max(self.cached_tokens, int(meta.get("cached_tokens", 0)))
                if new:
                    yield new
                if meta.get("finish_reason"):
                    yield meta["finish_reason"]
                    return
        except EngineHTTPError as e:
            if e.status < 500:
                raise ApiError("invalid_request", f"the engine refused the request: {e.body[:500]}") from None
            pool.mark_dead(eid, str(e))
        except _ENGINE_DOWN as e:
            pool.mark_dead(eid, repr(e))
        finally:
            self.engine_s += time.monotonic() - t0
            pool.inflight[eid].discard(rid)
            pool.table.end(eid)

    def _extend(self, new: list[int], lps: list[float], meta: dict, seen: int) -> None:
        if len(lps) != len(new):
            raise ApiError("api_error", f"engine returned {len(lps)} log-probs for {len(new)} tokens")
        spans = meta.get("weight_version_spans")
        if spans:  # the versions of output positions [seen, seen + len(new)) from the spans overlapping them
            end = seen + len(new)
            versions = [
                v
                for s in spans
                if s["end"] > seen and s["start"] < end
                for v in [parse_weight_version(s["weight_version"])] * (min(s["end"], end) - max(s["start"], seen))
            ]
        else:
            versions = [parse_weight_version(meta.get("weight_version", 0))] * len(new)
        self.output_ids += new
        self.logprobs += lps
        self.versions += versions

    async def _migrate(self, src: str, dst: str, prompt: list[int]) -> None:
        """Move the prompt's KV prefix from the engine the call left to the one it resumes on."""
        pool = self.pool
        s, d = pool.table.engines.get(src), pool.table.engines.get(dst)
        moved = 0
        if pool.migrate_kv and s and d and s.status == "draining" and s.supports_kv_export and d.supports_kv_export:
            try:
                moved = (await migrate_prefix(pool.clients[src], pool.clients[dst], prompt))["transferred_tokens"]
            except (*_ENGINE_DOWN, EngineHTTPError, KeyError) as e:
                log.warning("KV migration %s -> %s failed (recomputing): %r", src, dst, e)
        self.num_migrated += moved
        self.num_recomputed += len(prompt) - moved
        pool.metrics.num_migrated_tokens += moved
