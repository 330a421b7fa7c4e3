"""A transfer arena: memory touched once and registered once, carved into transfer buffers.

Why: a copy or a Mooncake read into freshly allocated memory pays a page fault per 4 KiB, which
doubled the cost of each copy of a KV hand-off (tools/bench/handoff.py: a 128 MiB read took 0.17
CPU-s into new memory, 0.09 into memory already touched). A real engine allocates and registers
its KV memory at start; this is the builtin engine's share of that for exports and imports.

A buffer goes back to the arena by itself once nothing references it: each buffer is a tensor over
its own numpy view of the arena, and a finalizer on that view frees the range when the last tensor
sharing it (a prefix-cache page, a slice an export is copying) is gone, so no caller can see its
bytes overwritten by a later transfer.
"""

import collections
import threading
import weakref

import numpy as np
import torch

ALIGN = 4096
"""Buffers start on page boundaries, so two never share a page."""


class RangeAllocator:
    """Best-fit allocation of byte ranges in [0, size), with neighbours merged on free (pure)."""

    def __init__(self, size: int):
        self.size = size
        self._free: list[list[int]] = [[0, size]] if size > 0 else []  # [offset, length], by offset

    @property
    def free_bytes(self) -> int:
        return sum(n for _, n in self._free)

    def take(self, nbytes: int) -> int | None:
        """The offset of a range of `nbytes` (> 0), or None when no free range is that long."""
        fits = [r for r in self._free if r[1] >= nbytes]
        if not fits:
            return None
        best = min(fits, key=lambda r: r[1])
        offset = best[0]
        best[0], best[1] = offset + nbytes, best[1] - nbytes
        if best[1] == 0:
            self._free.remove(best)
        return offset

    def give(self, offset: int, nbytes: int) -> None:
        """Free a range `take` returned."""
        i = next((i for i, r in enumerate(self._free) if r[0] > offset), len(self._free))
        self._free.insert(i, [offset, nbytes])
        if i + 1 < len(self._free) and offset + nbytes == self._free[i + 1][0]:
            self._free[i][1] += self._free.pop(i + 1)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            self._free[i - 1][1] += self._free.pop(i)[1]


class TransferArena:
    """`nbytes` of memory, touched now; `register` makes it one region of an endpoint (buffers are
    transferred only after that)."""

    def __init__(self, nbytes: int):
        self._memory = np.empty(nbytes, dtype=np.uint8)
        self._memory.fill(0)  # every page faulted in now, not during a hand-off
        self._ranges = RangeAllocator(nbytes)
        self._freed: collections.deque[tuple[int, int]] = collections.deque()
        """Ranges whose last reference died (finalizers run on any thread, so they only append)."""
        self._lock = threading.Lock()
        self.address = self._memory.ctypes.data

    def register(self, endpoint) -> None:
        if self._memory.size:
            endpoint.register(torch.from_numpy(self._memory))

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._collect()
            return self._ranges.free_bytes

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A registered uint8 buffer of `nbytes` inside the arena, or None when none is free."""
        span = -(-max(nbytes, 1) // ALIGN) * ALIGN
        with self._lock:
            self._collect()
            offset = self._ranges.take(span)
        if offset is None:
            return None
        view = self._memory[offset : offset + nbytes]
        weakref.finalize(view, self._freed.append, (offset, span))
        return torch.from_numpy(view)  # holds `view`: freed when this tensor and all its views are

    def _collect(self) -> None:
        while self._freed:
            self._ranges.give(*self._freed.popleft())
