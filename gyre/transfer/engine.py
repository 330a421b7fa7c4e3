"""A Mooncake Transfer Engine endpoint: register local memory, read/write a peer's registered memory.

Each process opens one endpoint; its `session_id` ("host:rpc_port", P2P handshake, no metadata
server) is what peers pass to reach it. Addresses are plain integers (tensor.data_ptr()), so a
peer's address must come to you out of band (an HTTP reply, an MPI message).
"""

import os
import threading

import torch

from gyre.errors import GyreError
from gyre.transfer.config import TransferConfig
from gyre.transfer.layout import BufferLayout


class TransferError(GyreError):
    """A Mooncake call failed (non-zero status); names the call and the peer."""


def _import_engine():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # the CUDA wheel fails to import without libcudart
        raise TransferError(
            "mooncake is not importable; install mooncake-transfer-engine-non-cuda on CPU machines "
            f"or mooncake-transfer-engine on GPU nodes ({e})"
        ) from e
    return TransferEngine


def coalesce(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge each (local, remote, bytes) range into the one before it where both sides continue
    it (a KV buffer's slabs, read whole into a buffer of the same shape): fewer, larger transfers."""
    out: list[list[int]] = []
    for local, remote, nbytes in ranges:
        if out and out[-1][0] + out[-1][2] == local and out[-1][1] + out[-1][2] == remote:
            out[-1][2] += nbytes
        else:
            out.append([local, remote, nbytes])
    return [(a, b, n) for a, b, n in out]


class TransferEndpoint:
    """One process's transfer endpoint, on the site's fabric (`transfer.protocol`, `transfer.device`:
    gyre.transfer.config) unless `fabric` names another."""

    def __init__(self, host: str = "127.0.0.1", fabric: TransferConfig | None = None):
        fabric = fabric or TransferConfig.from_env(os.environ)
        protocol, device = fabric.protocol, fabric.device
        if protocol == "tcp":  # read by Mooncake at initialize: without it, HCAs found mean RDMA
            os.environ["MC_FORCE_TCP"] = "1"
        else:
            os.environ.pop("MC_FORCE_TCP", None)
        self.protocol = protocol
        self._engine = _import_engine()()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferError(f"initialize({host!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}")
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, torch.Tensor] = {}  # keeps registered tensors alive
        self._lock = threading.Lock()
        self._transfer_lock = threading.Lock()
        """One transfer at a time: on TCP, 16 reads of 16 MiB from 4 threads at once took 3-5x as
        long as the same reads one after another (tools/bench/handoff.py's KV moves, measured)."""

    def register(self, tensor: torch.Tensor) -> int:
        """Register a contiguous tensor's memory for peers; returns its address."""
        if not tensor.is_contiguous():
            raise TransferError("register: tensor must be contiguous")
        addr = tensor.data_ptr()
        with self._lock:
            if addr in self._registered:
                return addr
            rc = self._engine.register_memory(addr, tensor.numel() * tensor.element_size())
            if rc != 0:
                raise TransferError(f"register_memory({addr:#x}) returned {rc}")
            self._registered[addr] = tensor
        return addr

    def unregister(self, tensor: torch.Tensor) -> None:
        """Withdraw a registered tensor; peers must no longer read or write it."""
        addr = tensor.data_ptr()
        with self._lock:
            if self._registered.pop(addr, None) is not None:
                self._engine.unregister_memory(addr)

    def read(self, peer: str, peer_addr: int, local: torch.Tensor, nbytes: int | None = None) -> None:
        """Copy `nbytes` (default: all of `local`) from the peer's address into registered `local`."""
        self._transfer("read", peer, peer_addr, local, nbytes)

    def write(self, peer: str, peer_addr: int, local: torch.Tensor, nbytes: int | None = None) -> None:
        """Copy `nbytes` (default: all of `local`) from registered `local` to the peer's address."""
        self._transfer("write", peer, peer_addr, local, nbytes)

    def _transfer(self, op: str, peer: str, peer_addr: int, local: torch.Tensor, nbytes: int | None) -> None:
        size = local.numel() * local.element_size()
        nbytes = size if nbytes is None else nbytes
        if nbytes > size:
            raise TransferError(f"{op} of {nbytes} bytes overruns the local tensor ({size} bytes)")
        if not self.covers(local.data_ptr(), nbytes):
            raise TransferError(f"{op}: the local tensor is not registered; call register() first")
        fn = self._engine.transfer_sync_read if op == "read" else self._engine.transfer_sync_write
        with self._transfer_lock:
            rc = fn(peer, local.data_ptr(), peer_addr, nbytes)
        if rc != 0:
            raise TransferError(f"transfer_sync_{op}(peer={peer!r}, addr={peer_addr:#x}, {nbytes} B) returned {rc}")

    def read_batch(self, peer: str, reads: list[tuple[int, int, int]]) -> None:
        """Copy many ranges from the peer with one batch transfer: each (local address inside a
        registered region, the peer's address, bytes)."""
        for local, _, nbytes in reads:
            if not self.covers(local, nbytes):
                raise TransferError(f"read_batch: local range {local:#x}+{nbytes} is not registered")
        reads = coalesce(reads)
        if not reads:
            return
        locals_, remotes, lengths = (list(x) for x in zip(*reads))
        with self._transfer_lock:
            rc = self._engine.batch_transfer_sync_read(peer, locals_, remotes, lengths)
        if rc != 0:
            raise TransferError(f"batch_transfer_sync_read(peer={peer!r}, {len(reads)} ranges) returned {rc}")

    def covers(self, addr: int, nbytes: int) -> bool:
        """Whether [addr, addr + nbytes) lies inside one registered region (a tensor, or an arena
        that buffers are carved from)."""
        with self._lock:
            return any(
                a <= addr and addr + nbytes <= a + t.numel() * t.element_size() for a, t in self._registered.items()
            )

    def publish_tensors(self, tensors: dict[str, torch.Tensor]) -> tuple[dict, torch.Tensor]:
        """Pack named tensors into one new registered buffer for peers to read.

        Returns (descriptor, buffer): the JSON-able descriptor {session_id, address, layout} goes to
        the reader out of band; keep `buffer` alive and unregister it once the reader is done.
        """
        layout = BufferLayout.for_tensors(tensors)
        descriptor, buf = self.allocate(layout)
        layout.pack(tensors, buf)
        return descriptor, buf

    def allocate(self, layout: BufferLayout) -> tuple[dict, torch.Tensor]:
        """A new registered buffer for `layout` and its descriptor (as `publish_tensors`); the
        caller fills the slots (`layout.unpack(buffer)`) before handing the descriptor to a peer."""
        buf = torch.empty(max(layout.nbytes, 1), dtype=torch.uint8)
        self.register(buf)
        return self.describe(buf, layout), buf

    def describe(self, buffer: torch.Tensor, layout: BufferLayout) -> dict:
        """The descriptor of a registered buffer (one of `allocate`'s, or carved from an arena)."""
        return {"session_id": self.session_id, "address": buffer.data_ptr(), "layout": layout.to_json()}

    def fetch_tensors(self, descriptor: dict, into: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Read the tensors a peer published (its `publish_tensors` descriptor) into `into` (a
        registered uint8 buffer of at least the layout's size) or else a new buffer that nothing
        else holds; returns views of it (no copy: a KV import keeps them as its pages)."""
        layout = BufferLayout.from_json(descriptor["layout"])
        if into is not None:
            self.read(descriptor["session_id"], int(descriptor["address"]), into, layout.nbytes)
            return layout.unpack(into)
        buf = torch.empty(max(layout.nbytes, 1), dtype=torch.uint8)
        self.register(buf)
        try:
            self.read(descriptor["session_id"], int(descriptor["address"]), buf, layout.nbytes)
        finally:
            self.unregister(buf)
        return layout.unpack(buf)

    def close(self) -> None:
        """Unregister everything this endpoint registered."""
        with self._lock:
            for addr in list(self._registered):
                self._engine.unregister_memory(addr)
            self._registered.clear()
