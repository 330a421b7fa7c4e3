"""SGLang 0.5.21's behaviour that the contract fake (gyre.engines.sglang_fake) models without a
server around it: what a request waits for (the model-update read/write lock, the pause gate), the
`weight_versions` spans, the environment's booleans.

    /generate, /health ─wait_unpaused─> reader ─────────────────> scheduler (the engine thread)
    weight updates, begin/end_weight_update ─(not paused)─> writer: waits for every reader

Upstream: `python/sglang/srt/utils/aio_rwlock.py` (the lock), `srt/managers/tokenizer_manager.py`
(`init_weight_update`, `generate_request`, `pause_generation`, `continue_generation`).
"""

import asyncio
import os
from contextlib import asynccontextmanager


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
