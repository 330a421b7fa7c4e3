"""KV prefix export/import between builtin engines over the Mooncake Transfer Engine.

Export: the source engine copies a cached prefix's KV pages into one registered buffer (off the
engine thread: cached pages are never written) and publishes (session_id, address, layout).
Import: the destination reads those bytes with one Mooncake read into a buffer, checks shapes
and weight version, and inserts the pages into its prefix cache as slots of that buffer (no copy),
so a moved session's next /generate reports them as cached_tokens instead of recomputing them.
Both buffers come from the engine's transfer arena (`engine.kv_arena_mib`, touched at start,
registered when the endpoint opens) while it has room, else from new memory: an imported buffer
stays in the arena until the cache evicts its last page.
"""

import asyncio
import itertools
import threading
from collections import OrderedDict

import torch

from gyre.engines.core import EngineRequestError
from gyre.records.versions import parse_weight_version
from gyre.transfer import TransferArena, TransferEndpoint
from gyre.transfer.layout import BufferLayout

MAX_EXPORTS = 8


class KVExporter:
    """Holds published buffers (at most MAX_EXPORTS; the oldest is withdrawn first), the engine's
    transfer endpoint (opened on first use) and its arena of `arena_bytes` (touched by `open`, or
    on first use)."""

    def __init__(self, arena_bytes: int = 0):
        self._arena_bytes = arena_bytes
        self._endpoint: TransferEndpoint | None = None
        self._arena: TransferArena | None = None
        self._exports: OrderedDict[str, tuple[torch.Tensor, bool]] = OrderedDict()
        """export id -> (buffer, whether it is the exporter's own registration, not the arena's)."""
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def open(self) -> None:
        """Touch the arena now (at start, not during the first hand-off); an engine that never
        moves KV or weights over Mooncake never opens an endpoint."""
        _ = self.arena

    @property
    def arena(self) -> TransferArena:
        with self._lock:
            if self._arena is None:
                self._arena = TransferArena(self._arena_bytes)
            return self._arena

    @property
    def endpoint(self) -> TransferEndpoint:
        arena = self.arena
        with self._lock:
            if self._endpoint is None:
                self._endpoint = TransferEndpoint()
                arena.register(self._endpoint)
            return self._endpoint

    def publish(self, pages: list[torch.Tensor]) -> dict:
        """Concatenate KV pieces [L, 2, n, nKV, hd] straight into a registered buffer (one copy)."""
        first = pages[0]
        shape = (*first.shape[:2], sum(p.shape[2] for p in pages), *first.shape[3:])
        layout = BufferLayout.for_tensors({"kv": torch.empty(shape, dtype=first.dtype, device="meta")})
        endpoint, buf = self.endpoint, self.arena.take(layout.nbytes)
        own = buf is None
        if own:
            descriptor, buf = endpoint.allocate(layout)
        else:
            descriptor = endpoint.describe(buf, layout)
        torch.cat(pages, dim=2, out=layout.unpack(buf)["kv"])
        export_id = str(next(self._ids))
        with self._lock:
            self._exports[export_id] = (buf, own)
            while len(self._exports) > MAX_EXPORTS:
                self._withdraw(*self._exports.popitem(last=False)[1])
        return {"export_id": export_id, **descriptor}

    def fetch(self, descriptor: dict) -> dict[str, torch.Tensor]:
        """Read a peer's published tensors into the arena (a new buffer when it has no room)."""
        nbytes = BufferLayout.from_json(descriptor["layout"]).nbytes
        endpoint = self.endpoint  # registers the arena before anything is read into it
        return endpoint.fetch_tensors(descriptor, self.arena.take(nbytes))

    def release(self, export_id: str) -> None:
        with self._lock:
            entry = self._exports.pop(export_id, None)
        if entry is not None:
            self._withdraw(*entry)

    def _withdraw(self, buf: torch.Tensor, own: bool) -> None:
        """An arena buffer goes back to the arena once dropped; the exporter's own is unregistered."""
        if own:
            self._endpoint.unregister(buf)

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()


async def import_kv_pages(server, body: dict) -> int:
    """Read the KV a peer exported and insert it into `server`'s prefix cache; returns tokens imported."""

    cfg = server.model_cfg
    tensors = await asyncio.to_thread(server.exporter.fetch, body)
    kv, ids, n = tensors.get("kv"), body["input_ids"], int(body["num_tokens"])
    want = (cfg.num_layers, 2, n, cfg.num_query_groups, cfg.head_dim)
    if kv is None or tuple(kv.shape) != want or kv.dtype != torch.float32:
        raise EngineRequestError(
            f"imported KV has shape {None if kv is None else tuple(kv.shape)}, this model needs {want} float32"
        )
    if len(ids) < n or (n and (min(ids[:n]) < 0 or max(ids[:n]) >= cfg.vocab_size)):
        raise EngineRequestError(f"input_ids must hold the {n} exported tokens, all inside the vocabulary")
    version, extra_key = parse_weight_version(body.get("weight_version")), body.get("extra_key")
    return await asyncio.to_thread(server.core.import_kv, ids[:n], kv, version, extra_key)  # no step wait
