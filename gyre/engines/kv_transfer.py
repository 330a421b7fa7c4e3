"""KV prefix export/import between builtin engines over the Mooncake Transfer Engine, batched.

A hand-off moves many sessions from one engine to another; it costs one export call on the source,
one import call on the destination and one Mooncake batch read, whatever the number of sessions:

    proxy ─export {sessions: [{input_ids, kv_from}]}─> source: each session's cached pages, where
          <── {session_id, sessions: [{num_tokens, ids, runs}]} ─┘  they lie (no copy: the cache
    proxy ─import (that answer)─> destination: one batch_transfer_sync_read of every run of every
                                  session (and its token ids) into its arena, then each session's
                                  pages into its prefix cache, pinned until the session's next call

The source's cached pages live in its transfer arena (`engine.kv_arena_mib`: touched at start,
registered once; the prefix cache copies new pages into it), as a GPU engine registers its KV pool,
so an export only names addresses; a page outside it (the arena was full) is copied into a
registered buffer first. A run (adjacent slots of one buffer [L, 2, n, nKV, hd]) is L x 2 contiguous
slabs, each one read. The token ids travel in the same read (int32, written by the source), so no
JSON body carries them twice. `kv_from` skips a session's first tokens: the prompt pages of a call in
flight move before its abort completes, then only its decoded tail follows.
"""

import itertools
import logging
import threading
from collections import OrderedDict

import torch

from gyre.engines.core import EngineRequestError
from gyre.records.versions import parse_weight_version
from gyre.transfer import TransferArena, TransferEndpoint, TransferError

log = logging.getLogger(__name__)

MAX_EXPORTS = 8
KV_DTYPE = torch.float32


def slabs(piece: torch.Tensor) -> list[torch.Tensor]:
    """The contiguous slabs [n, nKV, hd] of a KV piece [L, 2, n, nKV, hd], layer-major."""
    return [piece[layer, kv] for layer in range(piece.shape[0]) for kv in range(2)]


def describe_session(ids: torch.Tensor, pieces: list[torch.Tensor], kv_from: int) -> dict:
    """One session's entry of an export: its token ids (registered int32) and its KV from token
    `kv_from` on (registered pieces [L, 2, n, nKV, hd], in order), by address."""
    return {
        "num_tokens": int(ids.numel()),
        "kv_from": kv_from,
        "ids": ids.data_ptr(),
        "runs": [[p.shape[2], [s.data_ptr() for s in slabs(p)]] for p in pieces],
    }


def drop_tokens(pieces: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """The pieces without their first `n` tokens."""
    out = []
    for p in pieces:
        if n >= p.shape[2]:
            n -= p.shape[2]
            continue
        out.append(p[:, :, n:] if n else p)
        n = 0
    return out


class KVExporter:
    """The engine's transfer arena of `arena_bytes` (touched by `open`, or on first use), its
    endpoint (opened on first use), and the exports peers are reading (at most MAX_EXPORTS; the
    oldest is withdrawn first): each holds what it names, so no page it lists is freed meanwhile."""

    def __init__(self, arena_bytes: int = 0):
        self._arena_bytes = arena_bytes
        self._endpoint: TransferEndpoint | None = None
        self._arena: TransferArena | None = None
        self._exports: OrderedDict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = OrderedDict()
        """export id -> (tensors it names, the exporter's own registrations among them)."""
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def open(self) -> None:
        """Touch the arena and open the endpoint now, at start: in the first hand-off they would
        cost the page faults and Mooncake's initialize (~25 ms of CPU, measured). Where Mooncake
        cannot start, the engine serves on and the first move fails with the same error."""
        _ = self.arena
        try:
            _ = self.endpoint
        except TransferError as e:
            log.warning("no Mooncake endpoint at start: KV and weight moves will fail (%s)", e)

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

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor in the arena (new memory when it has no room): what the prefix
        cache copies pages into and imports read into."""
        nbytes = dtype.itemsize * torch.Size(shape).numel()
        buf = self.arena.take(nbytes)
        if buf is None:
            return torch.empty(shape, dtype=dtype)
        return buf.view(dtype).view(shape)

    def _registered(self, t: torch.Tensor, own: list[torch.Tensor]) -> torch.Tensor:
        """`t` if a peer can read it where it lies, else a registered copy (appended to `own` when
        the exporter registered it itself)."""
        endpoint = self.endpoint
        if all(s.is_contiguous() and endpoint.covers(s.data_ptr(), s.nbytes) for s in slabs(t)):
            return t
        return self._landing(tuple(t.shape), t.dtype, own).copy_(t)

    def export(self, sessions: list[tuple[list[int], list[torch.Tensor], int]]) -> dict:
        """Publish sessions' cached KV: each (token ids, cached pieces, kv_from); returns the
        descriptor (`export_id`, `session_id`, `sessions`) an importer reads."""
        held, own, entries, page_shape = [], [], [], None
        for ids, pieces, kv_from in sessions:
            if not pieces:
                entries.append({"num_tokens": 0, "kv_from": 0, "ids": 0, "runs": []})
                continue
            tail = [self._registered(p, own) for p in drop_tokens(pieces, kv_from)]
            id_buf = self._landing((len(ids),), torch.int32, own)
            id_buf.numpy()[:] = ids  # numpy converts a 16K-id list ~3x faster than torch.tensor
            held += [*tail, id_buf]
            entries.append(describe_session(id_buf, tail, kv_from))
            page_shape = [*pieces[0].shape[:2], *pieces[0].shape[3:]]
        export_id = str(next(self._ids))
        with self._lock:
            self._exports[export_id] = (held, own)
            while len(self._exports) > MAX_EXPORTS:
                self._withdraw(self._exports.popitem(last=False)[1][1])
        return {
            "export_id": export_id,
            "session_id": self.endpoint.session_id,
            "page_shape": page_shape,
            "sessions": entries,
        }

    def release(self, export_id: str) -> None:
        with self._lock:
            entry = self._exports.pop(export_id, None)
        if entry is not None:
            self._withdraw(entry[1])

    def _withdraw(self, own: list[torch.Tensor]) -> None:
        """Arena memory goes back to the arena once dropped; the exporter's own is unregistered."""
        for t in own:
            self._endpoint.unregister(t)

    def fetch(self, peer: str, sessions: list[dict], page_shape: tuple[int, ...]) -> list[tuple]:
        """Read sessions a peer exported with one batch read: each (token ids, KV [L, 2, n, nKV, hd]
        of tokens kv_from.., kv_from)."""
        layers, _, heads, dim = page_shape
        token_bytes = heads * dim * KV_DTYPE.itemsize
        endpoint, own, out, reads = self.endpoint, [], [], []
        try:
            for s in sessions:
                n, kv_from = int(s["num_tokens"]), int(s["kv_from"])
                ids, kv = (
                    self._landing((n,), torch.int32, own),
                    self._landing((layers, 2, n - kv_from, heads, dim), KV_DTYPE, own),
                )
                reads.append((ids.data_ptr(), int(s["ids"]), ids.nbytes))
                at = 0
                for num, addrs in s["runs"]:
                    if len(addrs) != layers * 2 or at + int(num) > n - kv_from:
                        raise EngineRequestError(f"an exported run does not fit this model's KV {page_shape}")
                    piece = kv[:, :, at : at + int(num)]
                    reads += [(d.data_ptr(), int(a), int(num) * token_bytes) for d, a in zip(slabs(piece), addrs)]
                    at += int(num)
                if at != n - kv_from:
                    raise EngineRequestError(f"the runs hold {at} tokens, the session exported {n - kv_from}")
                out.append((ids, kv, kv_from))
            endpoint.read_batch(peer, reads)
        finally:
            for t in own:
                endpoint.unregister(t)
        return out

    def _landing(self, shape: tuple[int, ...], dtype: torch.dtype, own: list[torch.Tensor]) -> torch.Tensor:
        """Registered memory to read into or export from: the arena's, else new memory registered
        for it (appended to `own`)."""
        t = self.allocate(shape, dtype)
        if t.numel() and not self.endpoint.covers(t.data_ptr(), t.nbytes):
            self.endpoint.register(t)
            own.append(t)
        return t

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()


def import_sessions(server, body: dict) -> list[dict]:
    """Read the KV a peer exported (`KVExporter.export`'s descriptor) and insert each session's
    pages into `server`'s prefix cache, pinned. Returns per session {transferred_tokens, refused}
    (a refusal, e.g. no room, fails that session only). Runs off the event loop."""
    cfg = server.model_cfg
    page_shape = (cfg.num_layers, 2, cfg.num_query_groups, cfg.head_dim)
    version, extra_key = parse_weight_version(body.get("weight_version")), body.get("extra_key")
    if version != server.core.weight_version:  # checked again under the cache's lock, per session
        raise EngineRequestError(
            f"KV was computed with weight_version {version}, this engine has {server.core.weight_version}"
        )
    sessions = body["sessions"]
    wanted = [i for i, s in enumerate(sessions) if int(s["num_tokens"]) > int(s["kv_from"])]
    if wanted and tuple(body["page_shape"]) != page_shape:
        raise EngineRequestError(f"exported KV pages are {body['page_shape']}, this model's are {list(page_shape)}")
    fetched = dict(zip(wanted, server.exporter.fetch(body["session_id"], [sessions[i] for i in wanted], page_shape)))
    out = []
    for i in range(len(sessions)):
        if i not in fetched:
            out.append({"transferred_tokens": 0, "refused": None})
            continue
        ids, kv, kv_from = fetched[i]
        try:
            if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:  # on the tensor: ~20x faster than on a list
                raise EngineRequestError(f"the {ids.numel()} exported token ids are not all inside the vocabulary")
            server.core.import_kv(ids.tolist(), kv, version, extra_key, kv_from=kv_from)
            out.append({"transferred_tokens": kv.shape[2], "refused": None})
        except EngineRequestError as e:
            out.append({"transferred_tokens": 0, "refused": str(e)})
    return out
