"""Paged prefix cache: KV of full token pages, found by walking a hash chain from the first page.

A page's key hashes (namespace, parent key, its tokens); the namespace holds the weight version
(and SGLang's `extra_key`), so KV computed with old weights is never matched after an update.
Lookups verify tokens and parents, so a hash collision can only miss, never return wrong KV.
Eviction is LRU; a chain is touched leaf-first so ancestors stay newer than descendants.
A page is a slot (its token offset) of a KV buffer: an imported buffer is shared by all its pages
and a match returns one view per run of adjacent slots, so a 16K-token import or export handles
one tensor, not a thousand page views (each costs microseconds of Python).
Imported pages (a session's KV moved here on a hand-off) are pinned until that session's next call
matches them: eviction skips them, and an import that does not fit beside the pinned pages is
refused (CacheFull) rather than evicting KV another moved session is about to use.
The cache is shared by the engine thread (admission, caching a prefill) and KV export/import
(HTTP handlers' threads, so a move never waits for a forward pass): every method holds `lock`.
"""

import threading
from dataclasses import dataclass

import torch


@dataclass
class Page:
    parent: int | None
    tokens: tuple[int, ...]
    buffer: torch.Tensor
    """[num_layers, 2, tokens, num_kv_heads, head_dim]: an import's whole buffer (shared by its
    pages) or a copied page's own."""
    start: int
    """Token offset of this page's KV in `buffer`."""
    last_used: int = 0
    pinned: bool = False


def _runs(pages: list[Page], page_size: int) -> list[torch.Tensor]:
    """The pages' KV, in order, as one view per run of adjacent slots of one buffer."""
    runs: list[list] = []  # [buffer, start, end]
    for p in pages:
        if runs and runs[-1][0] is p.buffer and runs[-1][2] == p.start:
            runs[-1][2] += page_size
        else:
            runs.append([p.buffer, p.start, p.start + page_size])
    return [b if (a, e) == (0, b.shape[2]) else b[:, :, a:e] for b, a, e in runs]


class CacheFull(ValueError):
    """An import needs more pages than the cache has room for beside its pinned pages."""


class PrefixCache:
    def __init__(self, page_size: int, capacity_tokens: int):
        self.page_size = page_size
        self.capacity_pages = capacity_tokens // page_size
        self._pages: dict[int, Page] = {}
        self._clock = 0
        self._num_pinned = 0
        self.lock = threading.RLock()
        """Held by every method; hold it to make a check and a change one step (EngineCore.import_kv)."""

    @property
    def num_tokens(self) -> int:
        return len(self._pages) * self.page_size

    def clear(self) -> None:
        with self.lock:
            self._pages.clear()
            self._num_pinned = 0

    def _walk(self, namespace: tuple, tokens: list[int]) -> list[tuple[int, tuple[int, ...]]]:
        keys, parent, ps = [], None, self.page_size
        for start in range(0, len(tokens) - ps + 1, ps):
            chunk = tuple(tokens[start : start + ps])
            key = hash((namespace, parent, chunk))
            keys.append((key, chunk))
            parent = key
        return keys

    def match(self, namespace: tuple, tokens: list[int]) -> list[torch.Tensor]:
        """KV of the longest cached page-aligned prefix of `tokens`, in pieces [L, 2, n, nKV, hd]
        to concatenate along dim 2 (empty: nothing cached)."""
        walk = self._walk(namespace, tokens)
        with self.lock:
            return self._match(walk)

    def _match(self, walk: list[tuple[int, tuple[int, ...]]]) -> list[torch.Tensor]:
        found, parent = [], None
        for key, chunk in walk:
            page = self._pages.get(key)
            if page is None or page.tokens != chunk or page.parent != parent:
                break
            found.append((key, page))
            parent = key
        for _key, page in reversed(found):
            self._clock += 1
            page.last_used = self._clock
            self._num_pinned -= page.pinned
            page.pinned = False
        return _runs([p for _, p in found], self.page_size)

    def insert(
        self, namespace: tuple, tokens: list[int], kv: torch.Tensor, pin: bool = False, copy: bool = True
    ) -> int:
        """Cache the full pages of `tokens` whose KV is `kv` [L, 2, >=len(tokens), nKV, hd]; returns pages added.

        `copy=False` keeps `kv` itself (an imported buffer nobody else writes): no copy, and the
        buffer's memory is freed once its last page is evicted.

        Raises:
            CacheFull: with `pin`, when the pages do not fit beside the pages already pinned.
        """
        walk = self._walk(namespace, tokens)
        with self.lock:
            return self._insert(walk, kv, pin, copy)

    def _insert(self, walk: list[tuple[int, tuple[int, ...]]], kv: torch.Tensor, pin: bool, copy: bool) -> int:
        added, ps = 0, self.page_size
        if pin:
            pinned = self._num_pinned
            want = sum(not (k in self._pages and self._pages[k].pinned) for k, _ in walk)
            if pinned + want > self.capacity_pages:
                raise CacheFull(
                    f"the prefix cache has room for {(self.capacity_pages - pinned) * ps} more pinned tokens, "
                    f"the import needs {want * ps}"
                )
        if self.capacity_pages == 0:
            return 0
        parent, newest = None, self._clock + len(walk)
        for i, (key, chunk) in enumerate(walk):
            page = self._pages.get(key)
            if page is None or page.tokens != chunk or page.parent != parent:
                self._num_pinned -= page is not None and page.pinned  # a hash collision replaces it
                if copy:
                    page = Page(parent, chunk, kv[:, :, i * ps : (i + 1) * ps].clone(), 0)
                else:
                    page = Page(parent, chunk, kv, i * ps)
                self._pages[key] = page
                added += 1
            page.last_used = newest - i  # one pass: the leaf gets the oldest mark, the root the newest
            if pin and not page.pinned:
                page.pinned = True
                self._num_pinned += 1
            parent = key
        self._clock = newest
        self._evict()
        return added

    def _evict(self) -> None:
        excess = len(self._pages) - self.capacity_pages
        if excess <= 0:
            return
        unpinned = [(k, p) for k, p in self._pages.items() if not p.pinned]
        for key, _ in sorted(unpinned, key=lambda kv: kv[1].last_used)[:excess]:
            del self._pages[key]
