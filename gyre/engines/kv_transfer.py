"""KV prefix export/import between builtin engines over the Mooncake Transfer Engine.

Export: the source engine copies a cached prefix's KV pages into one registered buffer (off the
engine thread: cached pages are never written) and publishes (session_id, address, layout).
Import: the destination reads those bytes with one Mooncake read into a new buffer, checks shapes
and weight version, and inserts the pages into its prefix cache as slots of that buffer (no copy),
so a moved session's next /generate reports them as cached_tokens instead of recomputing them.
"""

import asyncio
import itertools
import threading
from collections import OrderedDict

import torch

from gyre.engines.core import EngineRequestError
from gyre.records.versions import parse_weight_version
from gyre.transfer import TransferEndpoint
from gyre.transfer.layout import BufferLayout

MAX_EXPORTS = 8


class KVExporter:
    """Holds published buffers (at most MAX_EXPORTS; the oldest is withdrawn first)."""

    def __init__(self):
        self._endpoint: TransferEndpoint | None = None
        self._exports: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._ids = itertools.count()
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> TransferEndpoint:
        with self._lock:
            if self._endpoint is None:
                self._endpoint = TransferEndpoint()
            return self._endpoint

    def publish(self, pages: list[torch.Tensor]) -> dict:
        """Concatenate KV pieces [L, 2, n, nKV, hd] straight into a new registered buffer (one copy)."""
        first = pages[0]
        shape = (*first.shape[:2], sum(p.shape[2] for p in pages), *first.shape[3:])
        layout = BufferLayout.for_tensors({"kv": torch.empty(shape, dtype=first.dtype, device="meta")})
        descriptor, buf = self.endpoint.allocate(layout)
        torch.cat(pages, dim=2, out=layout.unpack(buf)["kv"])
        export_id = str(next(self._ids))
        with self._lock:
            self._exports[export_id] = buf
            while len(self._exports) > MAX_EXPORTS:
                self._endpoint.unregister(self._exports.popitem(last=False)[1])
        return {"export_id": export_id, **descriptor}

    def release(self, export_id: str) -> None:
        with self._lock:
            buf = self._exports.pop(export_id, None)
        if buf is not None:
            self.endpoint.unregister(buf)

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()


async def import_kv_pages(server, body: dict) -> int:
    """Read the KV a peer exported and insert it into `server`'s prefix cache; returns tokens imported."""

    cfg = server.model_cfg
    tensors = await asyncio.to_thread(server.exporter.endpoint.fetch_tensors, body)
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
