"""The builtin engine's scheduler: one compute thread runs continuous batching over a request queue.

    HTTP handlers ──submit(Request)──> incoming ─┐
    HTTP handlers ──call(fn) -> Future─> commands ┤   engine thread (one loop, owns all state):
                                                  └─>  run commands; admit waiting (prefix-cache match)
                                                       -> run_step(prefill chunks + decodes) -> sample
    Request.emit(snapshot, final) <────────────────────  per step; final on stop/length/abort

Everything mutable (queues, KV, weights) is touched only on the engine thread; control operations
(abort, pause, weight update, flush, memory) run there between steps as commands, so they never
race a forward pass. The prefix cache is the exception: it locks itself, so KV export/import (a
session's hand-off) runs on the caller's thread and never waits for a step.
"""

import concurrent.futures
import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gyre.engines.prefix_cache import CacheFull, PrefixCache, PrefixMissing
from gyre.engines.runner import SamplingParams, SeqKV, StepItem, run_step, sample
from gyre.engines.scripted import forced_logprob
from gyre.errors import GyreError
from gyre.models.config import ModelConfig
from gyre.models.transformer import check_weights

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache")


class EngineRequestError(GyreError):
    """A request the engine refuses (bad input, busy, wrong state): HTTP 400 with this message."""


@dataclass(eq=False)
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    emit: Callable[["Request", bool], None]
    """Called on the engine thread after each step with (request, finished)."""
    extra_key: str | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Weight version that produced each output token."""
    cached_tokens: int = 0
    finish: dict | None = None
    kv: SeqKV | None = None
    kv_clean: bool = True
    """All of `kv` was computed with the current weights (only then may it enter the prefix cache)."""
    prefilled: bool = False
    forced: list[int] | None = None
    """Tokens to emit instead of sampling (scripted policy in tests; log-probs stay the model's)."""
    gen: torch.Generator = field(default_factory=torch.Generator)

    def __post_init__(self):
        self.gen.manual_seed(self.params.seed if self.params.seed is not None else random.getrandbits(63))

    @property
    def tokens(self) -> list[int]:
        return self.input_ids + self.output_ids


class EngineCore:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        weight_version: int,
        *,
        max_running_requests: int,
        max_prefill_tokens: int,
        page_size: int,
        prefix_cache_tokens: int,
        allocate_kv: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    ):
        """`allocate_kv(shape, dtype)`: memory for the pages the prefix cache copies (the engine's
        registered transfer arena, so exports need no copy); default new memory."""
        check_weights(cfg, weights)
        self.cfg = cfg
        self.weights: dict[str, torch.Tensor] | None = weights
        self.weight_version = weight_version
        self.max_running, self.max_prefill = max_running_requests, max_prefill_tokens
        self.cache = PrefixCache(page_size, prefix_cache_tokens, *([allocate_kv] if allocate_kv else []))
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.paused = False
        self.released: set[str] = set()
        self.num_steps = 0
        self._incoming: list[Request] = []
        self._commands: list[tuple[Callable, concurrent.futures.Future]] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="gyre-engine", daemon=True)

    # --- thread-safe entry points -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, req: Request) -> None:
        with self._cv:
            self._incoming.append(req)
            self._cv.notify()

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread between steps; the future carries its result or error."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._commands.append((fn, fut))
            self._cv.notify()
        return fut

    def loads(self) -> dict:
        running, waiting = len(self.running), len(self.waiting) + len(self._incoming)
        used = sum(r.kv.length for r in list(self.running) if r.kv is not None)
        return {
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_used_tokens": used,
            "num_cached_tokens": self.cache.num_tokens,
            "paused": self.paused,
            "num_steps": self.num_steps,
        }

    # --- the loop -----------------------------------------------------------------------------
    def _can_run(self) -> bool:
        return bool(self.waiting or self.running) and not self.paused and not self.released

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stop or self._commands or self._incoming or self._can_run()):
                    self._cv.wait()
                if self._stop:
                    break
                commands, self._commands = self._commands, []
                self.waiting += self._incoming
                self._incoming = []
            for fn, fut in commands:
                try:
                    fut.set_result(fn())
                except Exception as e:  # delivered to the caller, never kills the loop
                    fut.set_exception(e)
            if self._can_run():
                try:
                    self._step()
                except Exception as e:  # a failed step ends its batch, not the server
                    log.exception("engine step failed; aborting %d running requests", len(self.running))
                    for r in list(self.running):
                        self._finish(r, {"type": "abort", "message": f"engine error: {e!r}"})
        for r in self.running + self.waiting:
            self._finish(r, {"type": "abort", "message": "engine shut down"})

    def _namespace(self, req: Request) -> tuple:
        return (self.weight_version, req.extra_key)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting.pop(0)
            pages = self.cache.match(self._namespace(req), req.tokens[:-1])
            req.kv = SeqKV(self.cfg, capacity=len(req.tokens) + req.params.max_new_tokens)
            req.kv.load_pages(pages)
            req.kv_clean = True
            if not req.output_ids:  # a retracted request keeps its first count
                req.cached_tokens = req.kv.length
            self.running.append(req)

    def _step(self) -> None:
        self._admit()
        items, owners, budget = [], [], self.max_prefill
        for req in self.running:
            pending = len(req.tokens) - req.kv.length
            n = pending if pending == 1 else min(pending, budget)
            if n <= 0:
                continue
            if pending > 1:
                budget -= n
            items.append(StepItem(req.kv, req.tokens[req.kv.length : req.kv.length + n], want_logits=n == pending))
            owners.append(req)
        if not items:
            return
        run_step(self.cfg, self.weights, items)
        self.num_steps += 1
        for req, item in zip(owners, items):
            if item.logits is None:
                continue
            if not req.prefilled:
                req.prefilled = True
                self._cache_kv(req)
            if req.params.max_new_tokens == 0:  # prefill only (e.g. to warm the prefix cache)
                self._finish(req, {"type": "length", "length": 0})
            else:
                self._advance(req, item.logits)

    def _advance(self, req: Request, logits: torch.Tensor) -> None:
        i = len(req.output_ids)
        if req.forced is not None and i < len(req.forced):
            tok = req.forced[i]
            logprob = forced_logprob(logits, tok, req.params.temperature)
        else:
            tok, logprob = sample(logits, req.params, req.gen)
        req.output_ids.append(tok)
        req.logprobs.append(logprob)
        req.versions.append(self.weight_version)
        p = req.params
        if tok in p.stop_token_ids:
            self._finish(req, {"type": "stop", "matched": tok})
        elif len(req.output_ids) >= p.max_new_tokens or len(req.tokens) >= self.cfg.max_seq_len:
            self._finish(req, {"type": "length", "length": len(req.output_ids)})
        else:
            req.emit(req, False)

    def _cache_kv(self, req: Request) -> None:
        if req.kv_clean and req.kv is not None and not self.released:
            self.cache.insert(self._namespace(req), req.tokens[: req.kv.length], req.kv.data)

    def _finish(self, req: Request, reason: dict) -> None:
        req.finish = reason
        if req in self.running:
            self.running.remove(req)
            self._cache_kv(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.kv = None
        req.emit(req, True)

    # --- commands (run on the engine thread via call()) ----------------------------------------
    def abort(self, rid: str | None = None, abort_all: bool = False, prefix: bool = False) -> int:
        """Finish matching requests with finish type abort; their partial output is returned.

        Args:
            prefix: match every rid that starts with `rid` (SGLang's scheduler does; the fake uses it).
        """
        self.waiting += self._take_incoming()
        victims = [
            r
            for r in self.running + self.waiting
            if abort_all or r.rid == rid or (prefix and rid and r.rid.startswith(rid))
        ]
        for r in victims:
            self._finish(r, {"type": "abort", "message": "aborted by request"})
        return len(victims)

    def _take_incoming(self) -> list[Request]:
        with self._cv:
            new, self._incoming = self._incoming, []
        return new

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise EngineRequestError(f"pause mode {mode!r} unknown; valid: {list(PAUSE_MODES)}")
        self.paused = True
        if mode == "abort":
            self.abort(abort_all=True)
        elif mode == "retract":
            for r in reversed(self.running):
                r.kv, r.prefilled = None, False
                self.waiting.insert(0, r)
            self.running.clear()

    def resume(self) -> None:
        self.paused = False

    def update_weights(self, weights: dict[str, torch.Tensor], version: int | None, flush_cache: bool) -> int:
        """Swap weights between steps; running requests continue on them (their spans say so)."""
        try:
            check_weights(self.cfg, weights)
        except ValueError as e:
            raise EngineRequestError(str(e)) from None
        self.weights = weights
        self.weight_version = version if version is not None else self.weight_version + 1
        for r in self.running:
            r.kv_clean = False
        if flush_cache:
            self.cache.clear()
        return self.weight_version

    def flush_cache(self) -> None:
        if self.running:
            raise EngineRequestError(f"cannot flush the cache: {len(self.running)} requests are running")
        self.cache.clear()

    def release_memory(self, tags: list[str]) -> None:
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise EngineRequestError(f"unknown memory tags {bad}; valid: {list(MEMORY_TAGS)}")
        if self.running:
            raise EngineRequestError(f"cannot release memory: {len(self.running)} requests are running")
        with self.cache.lock:  # an import on another thread sees the release or is cleared by it
            if "kv_cache" in tags:
                self.cache.clear()
            if "weights" in tags:
                self.weights = None
            self.released |= set(tags)

    def resume_memory(self, tags: list[str], weights: dict[str, torch.Tensor] | None) -> None:
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise EngineRequestError(f"unknown memory tags {bad}; valid: {list(MEMORY_TAGS)}")
        if "weights" in tags and "weights" in self.released:
            self.weights = weights
        self.released -= set(tags)

    def export_kv(self, input_ids: list[int], extra_key: str | None) -> tuple[int, list[torch.Tensor], int]:
        """The cached KV of the longest page-aligned prefix of `input_ids` (any thread: the cache
        locks itself, and pages are never written in place, so they may be copied after).

        Returns: (num_tokens, its pieces [L,2,n,nKV,hd] (PrefixCache.match), the weight version
        that computed them).
        """
        version = self.weight_version
        pages = self.cache.match((version, extra_key), input_ids)
        return sum(p.shape[2] for p in pages), pages, version

    def import_kv(
        self, tokens: list[int], kv: torch.Tensor, version: int, extra_key: str | None, kv_from: int = 0
    ) -> int:
        """Insert imported KV pages, pinned (any thread; under the cache's lock, so memory released
        meanwhile is either seen here or clears the pages after). `kv` holds tokens `kv_from`..
        (page-aligned; the pages before it came with an earlier import)."""
        with self.cache.lock:
            if version != self.weight_version:
                raise EngineRequestError(
                    f"KV was computed with weight_version {version}, this engine has {self.weight_version}"
                )
            if "kv_cache" in self.released:
                raise EngineRequestError("KV cache memory is released; resume it first")
            try:  # pinned until the session's next call uses it
                ps = self.cache.page_size
                if kv_from % ps:
                    raise EngineRequestError(f"kv_from {kv_from} is not a multiple of the page size {ps}")
                self.cache.insert((version, extra_key), tokens, kv, pin=True, copy=False, kv_from_page=kv_from // ps)
            except (CacheFull, PrefixMissing) as e:
                raise EngineRequestError(str(e)) from None
        return len(tokens) // self.cache.page_size * self.cache.page_size
