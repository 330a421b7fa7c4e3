"""Paged prefix cache: KV of full token pages, found by walking a hash chain from the first page.

A page's key hashes (namespace, parent key, its tokens); the namespace holds the weight version
(and SGLang's `extra_key`), so KV computed with old weights is never matched after an update.
Lookups verify tokens and parents, so a hash collision can only miss, never return wrong KV.
Eviction is LRU over an ordered dict of the unpinned pages (O(1) a page: it runs on every insert,
under the lock that a hand-off's export and import need); a chain is touched leaf-first so
ancestors stay newer than descendants.
A page is a slot (its token offset) of a KV buffer: an import's buffer is shared by all its pages,
as is the one buffer an insert copies its new pages into, and a match returns one view per run of
adjacent slots, so a 16K-token import or export handles one tensor, not a thousand page views (each
costs microseconds of Python). Copies are made with `allocate`: the builtin engine hands it its
registered transfer arena, so cached KV can be read by a peer where it lies (no copy on export), as
a GPU engine registers its KV pool.
Imported pages (a session's KV moved here on a hand-off) are pinned until that session's next call
matches them: eviction skips them, and an import that does not fit beside the pinned pages is
refused (CacheFull) rather than evicting KV another moved session is about to use.
The cache is shared by the engine thread (admission, caching a prefill) and KV export/import
(HTTP handlers' threads, so a move never waits for a forward pass): every method holds `lock`.
"""

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Page:
    parent: int | None
    tokens: tuple[int, ...]
    buffer: torch.Tensor
    """[num_layers, 2, tokens, num_kv_heads, head_dim]: an import's whole buffer (shared by its
    pages) or a copied page's own."""
    start: int
    """Token offset of this page's KV in `buffer`."""
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


class PrefixMissing(ValueError):
    """An insert of a chain's later pages whose earlier pages are not (or no longer) cached."""


def _new_runs(indices: list[int]) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive page indices."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, i + 1])
    return [(a, b) for a, b in runs]


class PrefixCache:
    def __init__(
        self,
        page_size: int,
        capacity_tokens: int,
        allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] = lambda shape, dtype: torch.empty(
            shape, dtype=dtype
        ),
    ):
        """`allocate(shape, dtype)`: an uninitialised tensor for the pages an insert copies."""
        self.page_size = page_size
        self.capacity_pages = capacity_tokens // page_size
        self._allocate = allocate
        self._pages: dict[int, Page] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        """Keys of the unpinned pages, least recently used first (pinned pages are never evicted)."""
        self._num_pinned = 0
        self.lock = threading.RLock()
        """Held by every method; hold it to make a check and a change one step (EngineCore.import_kv)."""

    @property
    def num_tokens(self) -> int:
        return len(self._pages) * self.page_size

    def clear(self) -> None:
        with self.lock:
            self._pages.clear()
            self._lru.clear()
            self._num_pinned = 0

    def _walk(self, namespace: tuple, tokens: list[int]) -> list[tuple[int, tuple[int, ...]]]:
        """Each full page's (key, tokens). The pages are cut by zip (in C): a 16K-token chain is
        walked on every export, import and finished call, some under a hand-off's clock."""
        chunks = list(zip(*[iter(tokens)] * self.page_size))
        keys, parent = [], None
        for chunk in chunks:
            parent = hash((namespace, parent, chunk))
            keys.append(parent)
        return list(zip(keys, chunks))

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
        lru = self._lru
        for key, page in reversed(found):  # most recently used and unpinned (inlined: ~1K pages a call)
            self._num_pinned -= page.pinned
            page.pinned = False
            lru[key] = None
            lru.move_to_end(key)
        return _runs([p for _, p in found], self.page_size)

    def insert(
        self,
        namespace: tuple,
        tokens: list[int],
        kv: torch.Tensor,
        pin: bool = False,
        copy: bool = True,
        kv_from_page: int = 0,
    ) -> int:
        """Cache the full pages of `tokens` whose KV is `kv` [L, 2, >=len(tokens), nKV, hd]; returns pages added.

        `copy=False` keeps `kv` itself (an imported buffer nobody else writes): no copy, and the
        buffer's memory is freed once its last page is evicted. `kv_from_page`: `kv` starts at that
        page (a move of a session's tail: its earlier pages came before and must still be here).

        Raises:
            CacheFull: with `pin`, when the pages do not fit beside the pages already pinned.
            PrefixMissing: a page before `kv_from_page` is not cached.
        """
        walk = self._walk(namespace, tokens)
        with self.lock:
            return self._insert(walk, kv, pin, copy, kv_from_page)

    def _insert(self, walk: list, kv: torch.Tensor, pin: bool, copy: bool, kv_from_page: int) -> int:
        if pin:
            want = sum(not (k in self._pages and self._pages[k].pinned) for k, _ in walk)
            if self._num_pinned + want > self.capacity_pages:
                raise CacheFull(
                    f"the prefix cache has room for {(self.capacity_pages - self._num_pinned) * self.page_size} "
                    f"more pinned tokens, the import needs {want * self.page_size}"
                )
        if self.capacity_pages == 0:
            return 0
        missing, parent = [], None
        for i, (key, chunk) in enumerate(walk):
            page = self._pages.get(key)
            if page is None or page.tokens != chunk or page.parent != parent:
                if i < kv_from_page:
                    raise PrefixMissing(f"page {i} of the chain is not cached; its KV had to come first")
                missing.append(i)
            parent = key
        buffer, slot = self._store(kv, missing, copy, kv_from_page)
        pages, lru = self._pages, self._lru
        for i in missing:
            key, chunk = walk[i]
            old = pages.get(key)
            if old is not None:  # a hash collision replaces it
                self._num_pinned -= old.pinned
                lru.pop(key, None)
            pages[key] = Page(walk[i - 1][0] if i else None, chunk, buffer, slot[i])
        for key, _ in reversed(walk):  # the leaf is touched first: the root ends newest
            page = pages[key]
            if pin or page.pinned:  # pinned pages stay out of the LRU order
                self._num_pinned += not page.pinned
                page.pinned = True
                lru.pop(key, None)
            else:
                lru[key] = None
                lru.move_to_end(key)
        self._evict()
        return len(missing)

    def _store(self, kv: torch.Tensor, missing: list[int], copy: bool, kv_from_page: int) -> tuple:
        """The buffer the missing pages live in and each one's token offset there: `kv` itself, or
        one `allocate`d buffer their KV is copied into, a run of adjacent pages at a time."""
        ps = self.page_size
        if not copy:
            return kv, {i: (i - kv_from_page) * ps for i in missing}
        shape = (*kv.shape[:2], len(missing) * ps, *kv.shape[3:])
        buffer, slot, at = self._allocate(shape, kv.dtype), {}, 0
        for a, b in _new_runs(missing):
            n = (b - a) * ps
            buffer[:, :, at : at + n].copy_(kv[:, :, (a - kv_from_page) * ps : (b - kv_from_page) * ps])
            slot |= {i: at + (i - a) * ps for i in range(a, b)}
            at += n
        return buffer, slot

    def _evict(self) -> None:
        while len(self._pages) > self.capacity_pages and self._lru:
            del self._pages[self._lru.popitem(last=False)[0]]
