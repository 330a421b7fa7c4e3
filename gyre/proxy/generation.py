"""One call's generation across engines: streams, resumes after a drain or a crash, moves its KV.

    handler ─Generation(prompt)─> pool.acquire(session) ─> engine A /generate (stream)
        ^                                   │ abort (hand-off) / connection lost (crash)
        └── new tokens ─────────────────────┤
                                            └─> pool.move_kv(A -> B) (if A alive), then release A
                                                (after a hand-off, only the tail decoded on A: the
                                                hand-off's batch moved the prompt meanwhile)
                                                ─> engine B /generate(prompt + partial output, rest of budget)

A drained or crashed engine's in-flight calls resume on another engine from input + the output
tokens already produced, so the harness sees one ordinary response; the record keeps one input
and the concatenated output with its log-probs and weight versions. An attempt stays on its
engine's books (pool.begin ... pool.end) until its KV has left, so a hand-off waits for it.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gyre.common import jsonio
from gyre.engines.client import EngineHTTPError, parse_version_spans
from gyre.proxy.chat import ApiError
from gyre.proxy.pool import ENGINE_DOWN, EnginePool
from gyre.records.versions import WeightVersionError, parse_weight_version, versions_between

log = logging.getLogger(__name__)


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
        held = None  # (rid, engine) of the attempt whose KV still has to leave its engine
        try:
            for attempt in range(self.max_resumes + 1):
                eid = await self.pool.acquire(self.session, frozenset([held[1]]) if held else frozenset())
                if not self.engine_ids and self.on_admit is not None:
                    self.on_admit()
                self.engine_ids.append(eid)
                if held is not None:
                    await self._move(held[1], eid)
                    self.pool.end(held[0])
                held = (f"{self.rid}-{attempt}", eid)
                self.pool.begin(held[0], eid, self.session, (self.input_ids, list(self.output_ids)))
                finish = None
                async for new in self._one_engine(eid, held[0]):
                    if isinstance(new, dict):
                        finish = new
                    else:
                        yield new
                if (finish is not None and finish.get("type") != "abort") or self._spent():
                    self.finish = "length" if finish is None or finish["type"] == "abort" else finish["type"]
                    self.pool.remember(self.session, self.input_ids, self.output_ids)
                    return
                self.pool.count_reroute()
            raise ApiError("api_error", f"call {self.rid} was interrupted {self.max_resumes + 1} times; giving up")
        finally:
            if held is not None:
                self.pool.end(held[0])

    def _spent(self) -> bool:
        return len(self.output_ids) >= self.sampling["max_new_tokens"]

    def _prompt_json(self) -> tuple[bytes, ...]:
        """The prompt of the next engine attempt (input + output so far) as JSON array pieces."""
        if not self.output_ids:
            return self.input_json
        return (*self.input_json[:-1], b"," + jsonio.dumpb(self.output_ids)[1:])

    async def _one_engine(self, eid: str, rid: str):
        """Stream from one engine; yields new-id lists, then the finish dict (nothing if the engine failed)."""
        client, prompt = self.pool.clients[eid], self._prompt_json()
        params = {**self.sampling, "max_new_tokens": self.sampling["max_new_tokens"] - len(self.output_ids)}
        seen, t0 = 0, time.monotonic()
        try:
            if self.incremental:
                chunks = client.generate_stream((), params, rid=rid, return_logprob=True, input_ids_json=prompt)
            else:
                chunks = _one(client.generate((), params, rid=rid, return_logprob=True, input_ids_json=prompt))
            async for chunk in chunks:
                ids, meta = chunk["output_ids"], chunk["meta_info"]
                new = ids[seen:]  # chunks are cumulative (SGLang's default, the builtin engine's)
                raw = meta.get("output_token_logprobs") or []
                self._extend(new, [x[0] for x in (raw[seen:] if len(raw) == len(ids) else raw)], meta, seen)
                seen += len(new)
                self.pool.count_output(eid, len(new))
                self.cached_tokens = max(self.cached_tokens, int(meta.get("cached_tokens", 0)))
                self.pool.count_cached(self.session, int(meta.get("cached_tokens", 0)))
                if new:
                    yield new
                if meta.get("finish_reason"):
                    yield meta["finish_reason"]
                    return
        except WeightVersionError as e:
            raise ApiError("api_error", f"engine {eid} reported a bad weight version: {e}") from None
        except EngineHTTPError as e:
            if e.status < 500:
                raise ApiError("invalid_request", f"the engine refused the request: {e.body[:500]}") from None
            self.pool.mark_dead(eid, str(e))
        except ENGINE_DOWN as e:
            self.pool.mark_dead(eid, repr(e))
        finally:
            self.engine_s += time.monotonic() - t0
            self.pool.stop_streaming(rid)

    def _extend(self, new: list[int], lps: list[float], meta: dict, seen: int) -> None:
        if len(lps) != len(new):
            raise ApiError("api_error", f"engine returned {len(lps)} log-probs for {len(new)} tokens")
        earlier = None  # this attempt's earlier tokens, where the spans say (SGLang's final chunk)
        try:
            spans = parse_version_spans(meta)
            if spans is not None:  # the versions of output positions [seen, seen + len(new))
                versions = versions_between(spans, seen, seen + len(new))
                earlier = versions_between(spans, 0, seen)
            else:
                versions = [parse_weight_version(meta.get("weight_version", 0))] * len(new)
        except (WeightVersionError, KeyError, TypeError, ValueError) as e:
            raise ApiError("api_error", f"engine returned bad weight versions: {e}") from None
        if len(versions) != len(new):
            raise ApiError("api_error", f"engine's version spans cover {len(versions)} of {len(new)} new tokens")
        if earlier is not None and seen and len(earlier) == seen:
            # SGLang tells only the server's version until its final chunk, whose spans settle them
            self.versions[len(self.versions) - seen :] = earlier
        self.output_ids += new
        self.logprobs += lps
        self.versions += versions

    async def _move(self, src: str, dst: str) -> None:
        """Move the KV of the prompt so far from the engine the call left to the one it resumes on."""
        prompt = np.concatenate((self.input_ids, np.asarray(self.output_ids, np.int32)))
        moved = await self.pool.move_kv(src, dst, prompt, self.session)
        self.num_migrated += moved
        self.num_recomputed += len(prompt) - moved
