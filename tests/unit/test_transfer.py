"""gyre.transfer: layouts round-trip named tensors; two endpoints move bytes over Mooncake TCP; an
arena hands out registered buffers and takes them back once nothing references them."""

import threading
import time

import pytest
import torch

from gyre.errors import GyreError
from gyre.transfer import BufferLayout, TransferArena, TransferEndpoint, TransferError
from gyre.transfer.arena import RangeAllocator
from gyre.transfer.engine import coalesce


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=g), "b": torch.arange(7), "c": torch.randn(2, generator=g).bfloat16()}


def test_layout_packs_unpacks_and_round_trips_json():
    ts = _tensors()
    layout = BufferLayout.for_tensors(ts)
    assert all(s.offset % 64 == 0 for s in layout.slots)
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.pack(ts, buf)
    again = BufferLayout.from_json(layout.to_json())
    assert again == layout
    for name, t in again.unpack(buf).items():
        assert torch.equal(t, ts[name])


def test_layout_rejects_overrun():
    obj = BufferLayout.for_tensors(_tensors()).to_json()
    obj["nbytes"] = 8
    with pytest.raises(GyreError, match="overruns"):
        BufferLayout.from_json(obj)


def test_endpoints_read_and_write_each_other():
    a, b = TransferEndpoint(), TransferEndpoint()
    src = torch.arange(4096, dtype=torch.float32)
    dst = torch.zeros(4096)
    src_addr, dst_addr = a.register(src), b.register(dst)
    b.read(a.session_id, src_addr, dst)
    assert torch.equal(dst, src)
    back = torch.full((16,), 7.0)
    b.register(back)
    b.write(a.session_id, src_addr, back)
    assert torch.equal(src[:16], back) and src[16] == 16
    with pytest.raises(TransferError, match="not registered"):
        b.read(a.session_id, src_addr, torch.zeros(4))
    a.close(), b.close()
    assert dst_addr == dst.data_ptr()


def test_a_batch_read_gathers_scattered_ranges_in_one_transfer():
    a, b = TransferEndpoint(), TransferEndpoint()
    src, dst = torch.arange(64, dtype=torch.float32), torch.zeros(64)
    a.register(src), b.register(dst)
    at = lambda t, i: t.data_ptr() + 4 * i  # noqa: E731
    b.read_batch(
        a.session_id, [(at(dst, 0), at(src, 32), 64), (at(dst, 16), at(src, 0), 32), (at(dst, 24), at(src, 8), 8)]
    )
    assert dst[:16].tolist() == list(range(32, 48)) and dst[16:26].tolist() == list(range(10))
    assert dst[26:].eq(0).all()
    with pytest.raises(TransferError, match="not registered"):
        b.read_batch(a.session_id, [(torch.zeros(4).data_ptr(), at(src, 0), 16)])
    a.close(), b.close()


@pytest.mark.parametrize(
    "ranges, merged",
    [
        pytest.param([], [], id="none"),
        pytest.param([(0, 100, 8), (8, 108, 8), (16, 116, 4)], [(0, 100, 20)], id="both-sides-continue"),
        pytest.param([(0, 100, 8), (8, 200, 8)], [(0, 100, 8), (8, 200, 8)], id="remote-jumps"),
        pytest.param([(0, 100, 8), (64, 108, 8)], [(0, 100, 8), (64, 108, 8)], id="local-jumps"),
        pytest.param([(0, 100, 8), (8, 108, 8), (32, 0, 4), (36, 4, 4)], [(0, 100, 16), (32, 0, 8)], id="two-runs"),
    ],
)
def test_coalesce_merges_ranges_that_continue_on_both_sides(ranges, merged):
    assert coalesce(ranges) == merged


def test_publish_and_fetch_named_tensors_into_new_memory_or_an_arena():
    a, b = TransferEndpoint(), TransferEndpoint()
    ts = _tensors()
    descriptor, buf = a.publish_tensors(ts)
    got = b.fetch_tensors(descriptor)
    assert set(got) == set(ts) and all(torch.equal(got[n], ts[n]) for n in ts)
    arena = TransferArena(4096)
    arena.register(b)
    into = arena.take(BufferLayout.from_json(descriptor["layout"]).nbytes)
    got = b.fetch_tensors(descriptor, into)  # no registration of its own: the arena's covers it
    assert all(torch.equal(got[n], ts[n]) for n in ts) and got["a"].data_ptr() == arena.address
    assert arena.take(1) is None  # full while `got` lives (a KV import then reads into new memory)
    a.unregister(buf)
    a.close(), b.close()


def test_an_arena_buffer_is_reused_only_once_nothing_references_it():
    """A buffer whose bytes a prefix-cache page (a view) still holds is never handed out again."""
    arena = TransferArena(3 * 4096)
    first = arena.take(5000)  # two pages
    page = first.view(torch.float32)[:16]  # what a cache page keeps of an import
    assert arena.take(8192) is None and arena.free_bytes == 4096
    del first
    assert arena.take(8192) is None  # the view still holds the buffer
    del page
    again = arena.take(8192)
    assert again is not None and again.data_ptr() == arena.address and arena.free_bytes == 4096


def test_an_endpoint_makes_one_transfer_at_a_time():
    """Concurrent Mooncake TCP reads were 3-5x slower than the same reads in turn: callers queue.
    The first transfer is held until the three other callers wait at the endpoint's transfer lock
    (or, were they let through, are inside a transfer too)."""
    ep = TransferEndpoint()
    dst = [torch.zeros(16) for _ in range(4)]
    for t in dst:
        ep.register(t)
    now, peak, lock, release = [0], [0], threading.Lock(), threading.Event()

    class Queue:  # the endpoint's transfer lock, counting the callers waiting at it
        def __init__(self, real: threading.Lock):
            self.real, self.waiting = real, 0

        def __enter__(self):
            with lock:
                self.waiting += 1
            self.real.acquire()
            with lock:
                self.waiting -= 1

        def __exit__(self, *exc):
            self.real.release()

    class Engine:  # stands in for mooncake's TransferEngine: counts the transfers under way
        def transfer_sync_read(self, peer, local, remote, n):
            with lock:
                now[0] += 1
                peak[0] = max(peak[0], now[0])
            release.wait(30)
            with lock:
                now[0] -= 1
            return 0

    real, ep._engine = ep._engine, Engine()
    queue = ep._transfer_lock = Queue(ep._transfer_lock)
    try:
        threads = [threading.Thread(target=ep.read, args=("peer", 0, t)) for t in dst]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while peak[0] == 0 or (peak[0] == 1 and queue.waiting < len(dst) - 1):
            assert time.monotonic() < deadline, (queue.waiting, peak[0])
            time.sleep(0.01)
        release.set()
        for t in threads:
            t.join()
    finally:
        ep._engine = real
        ep.close()
    assert peak[0] == 1


def test_range_allocator_takes_the_best_fit_and_merges_freed_neighbours():
    ranges = RangeAllocator(100)
    a, b, c = ranges.take(30), ranges.take(30), ranges.take(30)
    assert (a, b, c, ranges.take(20)) == (0, 30, 60, None)
    ranges.give(a, 30)
    ranges.give(c, 30)  # free: [0, 30) and [60, 100)
    assert ranges.take(25) == 0  # the 30-byte hole fits better than the 40-byte one
    ranges.give(0, 25)
    ranges.give(b, 30)  # [0, 100) again, in one piece
    assert ranges.free_bytes == 100 and ranges.take(100) == 0
