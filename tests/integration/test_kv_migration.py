"""KV prefix migration between two builtin engines over the Mooncake Transfer Engine (TCP), and the
KV exporter's arena over real endpoints."""

import asyncio

import pytest
import torch

from gyre.engines import kv_transfer
from gyre.engines.client import EngineClient, EngineHTTPError, migrate_prefix
from gyre.models.transformer import init_weights, sequence_logprobs
from gyre.transfer import TransferEndpoint
from tests.integration.engine_fixtures import MODEL, SEED, run, start_builtin


@pytest.fixture(scope="module")
def engines():
    a = start_builtin(max_prefill_tokens=512)  # the 2,000-token prefill runs in 4 chunks
    try:
        b = start_builtin(max_prefill_tokens=512)
    except BaseException:
        a.stop()
        raise
    yield a, b
    a.stop(), b.stop()


def test_a_2000_token_prefix_moves_from_a_to_b(engines):
    a, b = engines
    prefix = torch.randint(0, 256, (2000,), generator=torch.Generator().manual_seed(5)).tolist()
    greedy = {"max_new_tokens": 1, "temperature": 0}

    async def body():
        async with EngineClient(a.url) as ca, EngineClient(b.url) as cb:
            first = await ca.generate(prefix, greedy)  # computes and caches the prefix on A
            again = await ca.generate(prefix, greedy)  # A's own cache hit: same code path B will take
            moved = await migrate_prefix(ca, cb, prefix)
            on_b = await cb.generate(prefix, greedy)
            return first, again, moved, on_b

    first, again, moved, on_b = asyncio.run(body())
    assert moved["transferred_tokens"] >= 1900 and moved["transferred_tokens"] + moved["recomputed_tokens"] == 2000
    assert on_b["meta_info"]["cached_tokens"] >= 1900
    lp = lambda out: out["meta_info"]["output_token_logprobs"][0]  # noqa: E731
    assert lp(on_b) == lp(again)  # identical: same KV bytes, same computation
    assert lp(on_b)[1] == lp(first)[1] and abs(lp(on_b)[0] - lp(first)[0]) <= 1e-5
    ref = sequence_logprobs(MODEL, init_weights(MODEL, SEED), prefix + [lp(first)[1]])[-1]
    assert abs(float(ref) - lp(first)[0]) <= 1e-5  # chunked prefill == one full forward


def test_kv_from_other_weights_is_refused(engines):
    a, b = engines
    prefix = list(range(100, 164))

    async def body():
        async with EngineClient(a.url) as ca, EngineClient(b.url) as cb:
            await ca.generate(prefix, {"max_new_tokens": 1})
            export = await ca.export_kv(prefix)
            try:
                await cb.import_kv({**export, "input_ids": prefix, "weight_version": export["weight_version"] + 1})
            except EngineHTTPError as e:
                return export, e
            finally:
                await ca.release_kv_export(export["export_id"])

    export, err = asyncio.run(body())
    assert (
        export["num_tokens"] == 64
        and err.status == 400
        and "KV was computed with weight_version 1, this engine has 0" in err.body
    )


def test_nothing_cached_means_nothing_transferred(engines):
    a, b = engines
    moved = run(lambda ca: migrate_prefix(ca, ca, [9] * 40), a.url)
    assert moved == {"exported_tokens": 0, "transferred_tokens": 0, "recomputed_tokens": 40, "refused": None}


def _kv(n: int) -> torch.Tensor:
    return torch.arange(2 * 2 * n * 3, dtype=torch.float32).view(1, 2, n, 3, 2)


def test_exports_go_into_the_arena_while_it_has_room_and_else_into_new_registered_memory(monkeypatch):
    """Over real Mooncake endpoints: a peer reads both exports; releasing them unregisters only the
    exporter's own buffer and gives the arena's range back."""
    endpoint, peer = TransferEndpoint(), TransferEndpoint()
    monkeypatch.setattr(kv_transfer, "TransferEndpoint", lambda: endpoint)
    try:
        exporter = kv_transfer.KVExporter(arena_bytes=4096)
        small, large = [_kv(4), _kv(4)], [_kv(8)]
        in_arena, beyond = exporter.publish(small), exporter.publish(large)
        assert in_arena["address"] == exporter.arena.address != beyond["address"]
        assert exporter.arena.free_bytes == 0 and len(endpoint._registered) == 2  # the arena, the own buffer
        assert torch.equal(peer.fetch_tensors(in_arena)["kv"], torch.cat(small, dim=2))
        assert torch.equal(peer.fetch_tensors(beyond)["kv"], large[0])
        exporter.release(beyond["export_id"])
        exporter.release(in_arena["export_id"])
        assert list(endpoint._registered) == [exporter.arena.address] and exporter.arena.free_bytes == 4096
    finally:
        endpoint.close(), peer.close()
