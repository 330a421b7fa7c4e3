"""SGLang 0.5.21's behaviour that the contract fake (gyre.engines.sglang_fake) models without a
server around it: what a request waits for (the model-update read/write lock, the pause gate), the
`weight_versions` spans, the environment's booleans, HiCache's L3 store.

    /generate, /health ─wait_unpaused─> reader ─────────────────> scheduler (the engine thread)
    weight updates, begin/end_weight_update ─(not paused)─> writer: waits for every reader

Upstream: `python/sglang/srt/utils/aio_rwlock.py` (the lock), `srt/managers/tokenizer_manager.py`
(`init_weight_update`, `generate_request`, `pause_generation`, `continue_generation`).
"""

import asyncio
import hashlib
import os
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import torch
from aiohttp import web
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from gyre.common.files import write_atomic
from gyre.common.serve import exit_at_once
from gyre.common.sse import open_stream, send_events

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
"""srt/constants.py: the rid prefix of /health's one-token generation."""


class RWLock:
    """SGLang's `RWLock` (aio_rwlock.py, 0.5.21), writer-preferring: a writer waits until no reader
    holds the lock, and from the moment a writer waits no new reader enters. So an update waits for
    every generation in flight, and every generation that arrives meanwhile waits for the update."""

    def __init__(self):
        self._cond = asyncio.Condition()
        self.num_readers = 0
        self.writer_active = False
        self.num_waiting_writers = 0

    @property
    def locked(self) -> bool:
        """`RWLock.is_locked`: a reader or a writer holds it (`pause_generation(abort)` polls this)."""
        return self.writer_active or self.num_readers > 0

    @asynccontextmanager
    async def reader(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self.writer_active and self.num_waiting_writers == 0)
            self.num_readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self.num_readers -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def writer(self):
        async with self._cond:
            self.num_waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self.writer_active and self.num_readers == 0)
                self.writer_active = True
            finally:
                self.num_waiting_writers -= 1
        try:
            yield
        finally:
            async with self._cond:
                self.writer_active = False
                self._cond.notify_all()

    async def wait_unlocked(self, timeout_s: float) -> None:
        """Return once nobody holds the lock, or after `timeout_s` (the caller checks again)."""
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: not self.locked), timeout_s)
            except TimeoutError:
                pass


class PauseGate:
    """`TokenizerManager.is_pause` and `is_pause_cond` (tokenizer_manager.py, 0.5.21): while paused,
    a new /generate waits before it takes the read lock; weight updates check it to skip the lock."""

    def __init__(self):
        self.cond = asyncio.Condition()
        self.is_pause = False

    async def wait_unpaused(self) -> None:
        async with self.cond:
            await self.cond.wait_for(lambda: not self.is_pause)


def env_bool(name: str, default: bool) -> bool:
    """SGLang's `EnvBool` (srt/environ.py): true/1/yes/y, false/0/no/n, any case."""
    value = os.environ.get(name, "").lower()
    if not value:
        return default
    if value in ("true", "1", "yes", "y"):
        return True
    if value in ("false", "0", "no", "n"):
        return False
    raise ValueError(f'{name}: "{value}" is not a valid boolean value')


def label_spans(spans: list[dict], labels: dict[int, str], current: str) -> list[dict]:
    """The builtin core's spans of integer versions as SGLang's `weight_versions`: the version
    labels the updates carried, equal neighbours merged, and one empty span of the current version
    for a call with no output (utils/weight_versions.py `compute_weight_version_spans`)."""
    out: list[dict] = []
    for s in spans:
        label = labels.get(s["weight_version"], current)
        if out and out[-1]["version"] == label:
            out[-1]["end"] = s["end"]
        else:
            out.append({"version": label, "start": s["start"], "end": s["end"]})
    return out or [{"version": current, "start": 0, "end": 0}]


class L3Store:
    """HiCache's L3 storage (`--hicache-storage-backend mooncake`: a Mooncake store every server of a
    run shares) as one directory of pages. A page's key chains the hashes of the pages before it
    from a seed made of the call's `extra_key`, as SGLang keys storage (srt/mem_cache/utils.py
    `storage_namespace_seed`, `get_hash_str`), so servers share a prefix's KV by its content and
    never across `extra_key`s (Gyre's weight versions)."""

    def __init__(self, root: str | os.PathLike, page_size: int):
        self.root, self.page_size = Path(root), page_size
        self.root.mkdir(parents=True, exist_ok=True)

    def keys(self, tokens: list[int], extra_key: str | None) -> list[str]:
        """The keys of the full pages of `tokens`."""
        prior = hashlib.sha256(b"namespace" + (b"\x00" if extra_key is None else b"\x01" + extra_key.encode()))
        out, ps = [], self.page_size
        for start in range(0, len(tokens) - ps + 1, ps):
            prior = hashlib.sha256(prior.digest() + b",".join(str(t).encode() for t in tokens[start : start + ps]))
            out.append(prior.hexdigest())
        return out

    def load(self, tokens: list[int], extra_key: str | None) -> tuple[int, torch.Tensor | None]:
        """(n, KV [L, 2, n, nKV, hd]) of the longest prefix of `tokens` whose pages the store holds."""
        pages = []
        for key in self.keys(tokens, extra_key):
            path = self.root / key
            if not path.exists():
                break
            pages.append(load_tensors(path.read_bytes())["kv"])
        return len(pages) * self.page_size, torch.cat(pages, dim=2) if pages else None

    def save(self, tokens: list[int], kv: torch.Tensor, extra_key: str | None) -> None:
        """Write through the pages of `tokens` (KV [L, 2, >= len(tokens), nKV, hd]) the store lacks."""
        ps = self.page_size
        for i, key in enumerate(self.keys(tokens, extra_key)):
            path = self.root / key
            if not path.exists():
                data = save_tensors({"kv": kv[:, :, i * ps : (i + 1) * ps].contiguous()})
                write_atomic(path, data)  # readers see a whole page or none


def scheduler_crash(message: str) -> None:
    """An assertion in SGLang's scheduler process: it logs, SIGQUITs the server, and every process
    of the server exits (scheduler.py `run_scheduler_process`); the request gets no answer."""
    print(f"Scheduler hit an exception: AssertionError: {message}", file=sys.stderr)
    exit_at_once(1)


async def stream_error(request: web.Request, message: str) -> web.StreamResponse:
    """A streamed call's error as SGLang sends it: HTTP 200, one error chunk, then [DONE]."""
    error = {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}
    async with open_stream(request) as stream:
        await send_events(stream, [(None, {"error": error}), (None, "[DONE]")])
    return stream


def reply(success: bool, message: str, **extra) -> web.Response:
    """A weight route's answer: 200 or 400 with {"success", "message"} (http_server.py)."""
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)
