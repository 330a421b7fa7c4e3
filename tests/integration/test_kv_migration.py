"""KV prefix migration between two builtin engines over the Mooncake Transfer Engine (TCP), and the
KV exporter's arena over real endpoints."""

import asyncio

import pytest
import torch

from gyre.engines import kv_transfer
from gyre.engines.client import EngineClient, EngineHTTPError, migrate_prefixes
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


def test_two_sessions_move_from_a_to_b_in_one_batch_and_a_tail_follows_its_prefix(engines):
    a, b = engines
    gen = torch.Generator().manual_seed(5)
    prefix, other = (
        torch.randint(0, 256, (2000,), generator=gen).tolist(),
        torch.randint(0, 256, (700,), generator=gen).tolist(),
    )
    third = torch.randint(0, 256, (400,), generator=gen).tolist()
    greedy = {"max_new_tokens": 1, "temperature": 0}

    async def body():
        async with EngineClient(a.url) as ca, EngineClient(b.url) as cb:
            first = await ca.generate(prefix, greedy)  # computes and caches the prefix on A
            await ca.generate(other, greedy)
            again = await ca.generate(prefix, greedy)  # A's own cache hit: same code path B will take
            head = await migrate_prefixes(ca, cb, [(prefix[:1024], 0), (other, 0)])  # one export, one read
            await ca.generate(third, greedy)
            orphan = await migrate_prefixes(ca, cb, [(third, 320)])  # its first 320 tokens are not on B
            tail = await migrate_prefixes(ca, cb, [(prefix, 1024)])  # only what B lacks moves
            on_b = await cb.generate(prefix, greedy)
            return first, again, head, orphan, tail, on_b, await cb.generate(other, greedy)

    first, again, head, orphan, tail, on_b, other_on_b = asyncio.run(body())
    assert [m["transferred_tokens"] for m in head] == [1024, 688] and head[1]["recomputed_tokens"] == 12
    assert orphan[0]["transferred_tokens"] == 0 and "not cached" in orphan[0]["refused"]
    assert tail == [{"exported_tokens": 976, "transferred_tokens": 976, "recomputed_tokens": 0, "refused": None}]
    assert on_b["meta_info"]["cached_tokens"] == 1984 and other_on_b["meta_info"]["cached_tokens"] == 688
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
            export = await ca.export_kv([(prefix, 0)])
            try:
                await cb.import_kv({**export, "weight_version": export["weight_version"] + 1})
            except EngineHTTPError as e:
                return export, e
            finally:
                await ca.release_kv_export(export["export_id"])

    export, err = asyncio.run(body())
    assert (
        export["sessions"][0]["num_tokens"] == 64
        and err.status == 400
        and "KV was computed with weight_version 1, this engine has 0" in err.body
    )


def test_nothing_cached_means_nothing_transferred(engines):
    a, b = engines
    moved = run(lambda ca: migrate_prefixes(ca, ca, [([9] * 40, 0)]), a.url)
    assert moved == [{"exported_tokens": 0, "transferred_tokens": 0, "recomputed_tokens": 40, "refused": None}]


def _kv(n: int) -> torch.Tensor:
    return torch.arange(2 * 2 * n * 3, dtype=torch.float32).view(1, 2, n, 3, 2)


def test_pages_in_the_arena_are_exported_where_they_lie_and_others_through_a_registered_copy(monkeypatch):
    """Over real Mooncake endpoints: a peer reads both sessions with one batch read; releasing the
    export unregisters only the exporter's own copies."""
    endpoints = [TransferEndpoint(), TransferEndpoint()]
    mine = iter(endpoints)
    monkeypatch.setattr(kv_transfer, "TransferEndpoint", lambda: next(mine))
    try:
        exporter, reader = kv_transfer.KVExporter(arena_bytes=2 * 4096), kv_transfer.KVExporter(arena_bytes=1 << 16)
        cached = exporter.allocate((1, 2, 8, 3, 2), torch.float32).copy_(_kv(8))  # as the prefix cache copies
        plain = _kv(4) + 1000
        export = exporter.export(
            [(list(range(8)), [cached[:, :, :4], cached[:, :, 4:]], 0), (list(range(4)), [plain], 0)]
        )
        arena = exporter.arena.address
        in_place, copied = export["sessions"]
        assert [addrs[0] for _, addrs in in_place["runs"]] == [cached.data_ptr(), cached[:, :, 4:].data_ptr()]
        assert copied["runs"][0][1][0] != plain.data_ptr() and len(endpoints[0]._registered) == 3  # arena + 2 own
        got = reader.fetch(export["session_id"], export["sessions"], (1, 2, 3, 2))
        assert [ids.tolist() for ids, _, _ in got] == [list(range(8)), list(range(4))]
        assert torch.equal(got[0][1], _kv(8)) and torch.equal(got[1][1], plain)
        exporter.release(export["export_id"])
        assert list(endpoints[0]._registered) == [arena] and in_place["ids"] >= arena
    finally:
        for e in endpoints:
            e.close()
