"""The engine pool's hand-off and rebalance over fake engine clients (the edge faked, the pool real):
when a hand-off returns, every move has ended; a session's next call waits for its move; what
cannot move, and what a session routed off a dead or overloaded engine recomputes, is counted as
re-prefill, never raised."""

import asyncio

import numpy as np
import pytest

import gyre.proxy.pool as pool_module
from gyre.engines.client import EngineHTTPError
from gyre.proxy.config import ProxyConfig
from gyre.proxy.pool import EnginePool


class FakeEngine:
    """What the pool calls on an engine client; exports wait for `gate` (counted in `num_held`),
    imports may be refused."""

    gate: asyncio.Event | None = None
    num_held: int = 0
    refuse: bool = False
    log: list = []

    def __init__(self, url: str, timeout_s: float):
        self.url, self.weight_version, self.key_by_weight_version = url, 0, False

    async def __aenter__(self):
        return self

    async def close(self):
        pass

    async def model_info(self):
        return {"engine": "gyre-builtin", "page_size": 16, "weight_version": 0}

    async def health(self):
        return True

    async def abort(self, rid):
        self.log.append(("abort", self.url, rid))

    async def export_kv(self, sessions, extra_key=None):
        self.log.append(("export", self.url, [(len(ids), kv_from) for ids, kv_from in sessions]))
        FakeEngine.num_held += 1
        await FakeEngine.gate.wait()
        FakeEngine.num_held -= 1
        return {"export_id": "x", "sessions": [{"num_tokens": len(i) // 16 * 16, "kv_from": f} for i, f in sessions]}

    async def import_kv(self, export, extra_key=None):
        if FakeEngine.refuse:
            raise EngineHTTPError(400, "/gyre/import_kv", "the prefix cache has room for 0 more pinned tokens")
        moved = [s["num_tokens"] - s["kv_from"] for s in export["sessions"]]
        self.log.append(("import", self.url, moved))
        return {"sessions": [{"transferred_tokens": n, "refused": None} for n in moved]}

    async def release_kv_export(self, export_id):
        pass


@pytest.fixture
def fake_engines(monkeypatch):
    monkeypatch.setattr(pool_module, "EngineClient", FakeEngine)
    FakeEngine.refuse, FakeEngine.log, FakeEngine.num_held = False, [], 0


class FakeClock:
    """The pool's time.monotonic, moved by the test: decode counters integrate exact seconds."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


async def _until(condition, timeout_s: float = 5.0) -> None:
    """Let the pool's tasks run until `condition()` holds (bounded)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _settle() -> None:
    """Let every task that is ready run to its next wait (no time passes): what a wait the test
    expects must still be waiting has had its chance to end."""
    for _ in range(10):
        await asyncio.sleep(0)


async def _pool(**cfg) -> EnginePool:
    FakeEngine.gate = asyncio.Event()
    pool = EnginePool(ProxyConfig(no_engine_wait_s=1, **cfg))
    for eid in ("a", "b"):
        await pool.register(eid, f"http://{eid}")
    return pool


async def _idle_session(pool: EnginePool, session: str, n: int) -> str:
    eid = await pool.acquire(session, frozenset())
    pool.remember(session, np.arange(n, dtype=np.int32), [1, 2, 3])
    return eid


def test_a_hand_off_returns_only_once_every_move_has_ended(fake_engines):
    async def main():
        pool = await _pool()
        await pool.stop_admission("b")
        assert await _idle_session(pool, "x/main", 200) == "a"
        pool.begin("call-0", await pool.acquire("y/main", frozenset()), "y/main")  # a call in flight on a
        await pool.activate("b")
        hand_off = asyncio.create_task(pool.hand_off("a"))
        await _until(lambda: ("abort", "http://a", "call-0") in FakeEngine.log and FakeEngine.num_held == 1)
        await _settle()
        assert not hand_off.done()  # the idle session's export is held at the gate
        next_call = asyncio.create_task(pool.acquire("x/main", frozenset()))
        await _settle()
        assert not next_call.done()  # the session's next call waits for its KV
        FakeEngine.gate.set()
        assert await asyncio.wait_for(next_call, 2) == "b"
        await _settle()
        assert not hand_off.done()  # the aborted call's KV has not left yet
        pool.stop_streaming("call-0")
        pool.end("call-0")
        out = await asyncio.wait_for(hand_off, 2)
        return out, pool.metrics

    out, m = asyncio.run(main())
    assert out == {"num_aborted": 1, "num_sessions": 2}
    assert (m.kv_migrated_tokens, m.kv_reprefill_tokens, m.num_sessions_moved) == (192, 0, 1)
    assert ("import", "http://b", [192]) in FakeEngine.log


@pytest.mark.parametrize("case_id, refuse, gate_open", [("target-full", True, True), ("timeout", False, False)])
def test_kv_that_cannot_move_is_counted_as_reprefill(fake_engines, case_id, refuse, gate_open):
    async def main():
        pool = await _pool(kv_move_timeout_s=0.3)
        FakeEngine.refuse = refuse
        await pool.stop_admission("b")
        await _idle_session(pool, "x/main", 200)
        await pool.activate("b")
        if gate_open:
            FakeEngine.gate.set()
        await asyncio.wait_for(pool.hand_off("a"), 2)
        return await pool.acquire("x/main", frozenset()), pool.metrics

    eid, m = asyncio.run(main())
    assert eid == "b" and (m.kv_migrated_tokens, m.kv_reprefill_tokens) == (0, 192)


def test_a_returning_engine_takes_idle_sessions_with_their_kv(fake_engines):
    async def main():
        pool = await _pool(rebalance_on_return=True)
        await pool.stop_admission("b")
        for i in range(4):
            await _idle_session(pool, f"s{i}/main", 64)
        FakeEngine.gate.set()
        out = await pool.activate("b")
        await _until(lambda: pool.metrics.num_sessions_moved == out["num_sessions"])  # the moves ended
        return out, {e["engine_id"]: e["num_sessions"] for e in pool.describe()}, pool.metrics

    out, sessions, m = asyncio.run(main())
    assert out == {"num_sessions": 2} and sessions == {"a": 2, "b": 2}
    assert (m.kv_migrated_tokens, m.num_sessions_moved) == (2 * 64, 2)
    assert [e for e in FakeEngine.log if e[0] == "import"] == [("import", "http://b", [64, 64])]  # one batch


def test_a_hand_off_moves_a_pairs_sessions_in_one_batch_with_the_prompts_of_calls_in_flight(fake_engines):
    """Idle sessions and the prompt of a call in flight go in one export and one import, started
    beside the abort; the aborted call's own move then carries only the tail it decoded."""

    async def main():
        pool = await _pool()
        await pool.stop_admission("b")
        await _idle_session(pool, "x/main", 200)
        await _idle_session(pool, "z/main", 200)
        prompt = np.arange(100, dtype=np.int32)
        pool.begin("call-0", await pool.acquire("y/main", frozenset()), "y/main", (prompt, []))
        await pool.activate("b")
        FakeEngine.gate.set()
        hand_off = asyncio.create_task(pool.hand_off("a"))
        await _until(lambda: any(e[0] == "import" for e in FakeEngine.log))
        await _settle()
        assert not hand_off.done()  # the aborted call still holds a
        pool.stop_streaming("call-0")  # what Generation does after the abort: next engine, its tail
        resumed_on = await pool.acquire("y/main", frozenset(["a"]))
        moved = await pool.move_kv("a", resumed_on, [*range(100), *range(40)], "y/main")
        pool.end("call-0")
        out = await asyncio.wait_for(hand_off, 2)
        return out, resumed_on, moved, pool.metrics

    out, resumed_on, moved, m = asyncio.run(main())
    assert out == {"num_aborted": 1, "num_sessions": 3} and resumed_on == "b"
    moves = [(op, url, sorted(sizes)) for op, url, sizes in FakeEngine.log if op in ("export", "import")]
    assert moves == [
        ("export", "http://a", [(100, 0), (203, 0), (203, 0)]),
        ("import", "http://b", [96, 192, 192]),
        ("export", "http://a", [(140, 96)]),  # the tail: the 96 prompt tokens moved already
        ("import", "http://b", [32]),
    ]
    assert moved == 128 and (m.kv_migrated_tokens, m.kv_reprefill_tokens, m.num_sessions_moved) == (512, 0, 2)


def test_a_tail_shorter_than_a_page_after_its_prompt_moved_costs_no_engine_call(fake_engines):
    """An aborted call that decoded less than a page since its prompt moved has no page left to
    move: its own move returns at once, with nothing counted as re-prefill."""

    async def main():
        pool = await _pool()
        await pool.stop_admission("b")
        pool.begin("call-0", await pool.acquire("y/main", frozenset()), "y/main", (np.arange(100, dtype=np.int32), []))
        await pool.activate("b")
        FakeEngine.gate.set()
        hand_off = asyncio.create_task(pool.hand_off("a"))
        await _until(lambda: any(e[0] == "import" for e in FakeEngine.log))
        pool.stop_streaming("call-0")
        FakeEngine.log.clear()
        moved = await pool.move_kv("a", "b", [*range(100), *range(10)], "y/main")
        pool.end("call-0")
        await asyncio.wait_for(hand_off, 2)
        return moved, pool.metrics

    moved, m = asyncio.run(main())
    assert not [e for e in FakeEngine.log if e[0] in ("export", "import")]
    assert moved == 96 and (m.kv_migrated_tokens, m.kv_reprefill_tokens) == (96, 0)


def test_idle_sessions_with_no_engine_to_go_to_are_counted_as_reprefill(fake_engines):
    """With no other active engine a leaving engine's idle sessions stay routed to it; its memory
    is released after the hand-off, so their next call recomputes their context: counted."""

    async def main():
        pool = await _pool()
        await pool.stop_admission("b")
        await _idle_session(pool, "x/main", 200)
        out = await asyncio.wait_for(pool.hand_off("a"), 2)
        return out, pool.metrics

    out, m = asyncio.run(main())
    assert out == {"num_aborted": 0, "num_sessions": 0}
    assert (m.kv_migrated_tokens, m.kv_reprefill_tokens) == (0, 192)  # 203 tokens, 16-token pages


def test_the_pool_counts_each_engines_output_tokens_and_call_time(fake_engines, monkeypatch):
    """The decode counters the live Observation is measured from (gyre.scheduler.decode)."""
    clock = FakeClock()
    monkeypatch.setattr(pool_module, "time", clock)

    async def main():
        pool = await _pool()
        pool.begin("c0", "a", "x/main")
        pool.begin("c1", "a", "y/main")
        clock.now += 2.0
        pool.count_output("a", 7)
        pool.stop_streaming("c0")
        clock.now += 1.0  # c1 alone
        pool.end("c1")  # ends streaming too
        pool.end("c0")
        before = pool.describe()[0]["busy_s"]
        clock.now += 5.0  # idle: no call time accrues
        return before, {e["engine_id"]: e for e in pool.describe()}

    before, engines = asyncio.run(main())
    a, b = engines["a"], engines["b"]
    assert a["output_tokens"] == 7 and (b["output_tokens"], b["call_s"], b["busy_s"]) == (0, 0.0, 0.0)
    assert a["busy_s"] == before == 3.0 and a["call_s"] == 2 * 2.0 + 1.0  # two calls for 2 s, then one for 1 s


async def _rerouted(pool: EnginePool, cached_tokens: int) -> tuple[str, int]:
    """The idle session x/main's next call: its engine, and the re-prefill counted once its first
    answer says `cached_tokens` (what its new engine already held of the prompt)."""
    eid = await pool.acquire("x/main", frozenset())
    pool.count_cached("x/main", cached_tokens)
    pool.count_cached("x/main", cached_tokens)  # every chunk reports it: counted once
    assert pool.metrics.kv_reprefill_rerouted_tokens == pool.metrics.kv_reprefill_tokens
    return eid, pool.metrics.kv_reprefill_tokens


@pytest.mark.parametrize(
    "cached_tokens, reprefill",
    [(0, 192), (32, 160), (500, 0)],
    ids=["nothing-cached", "shared-prefix-cached", "all-cached"],
)
def test_a_session_of_an_engine_marked_dead_counts_its_reprefill(fake_engines, cached_tokens, reprefill):
    """Its next call goes to another engine without its KV (the dead engine's is gone): what that
    engine did not hold already (203 tokens, 16-token pages: 192) is recomputed, and counted."""

    async def main():
        pool = await _pool()
        await pool.stop_admission("b")
        await _idle_session(pool, "x/main", 200)
        await pool.activate("b")
        pool.mark_dead("a", "health check failed")
        return await _rerouted(pool, cached_tokens)

    assert asyncio.run(main()) == ("b", reprefill)


def test_a_session_moved_for_imbalance_counts_its_reprefill_and_a_staying_one_none(fake_engines):
    """A session whose engine carries more than max_imbalance calls beyond the least loaded one
    moves there without its KV: counted; one within the bound stays on its engine: nothing counted."""

    async def main():
        pool = await _pool(max_imbalance=1)
        await pool.stop_admission("b")
        await _idle_session(pool, "x/main", 200)
        await pool.activate("b")
        pool.begin("c0", "a", "y/main")
        stays = await _rerouted(pool, 0)
        pool.begin("c1", "a", "z/main")
        return stays, await _rerouted(pool, 0)

    assert asyncio.run(main()) == (("a", 0), ("b", 192))


def test_a_call_rerouted_mid_way_is_not_counted_twice(fake_engines):
    """A call that leaves its engine mid-way (the engine excluded) moves its own KV (move_kv counts
    what does not arrive): its session's reroute adds nothing on top."""

    async def main():
        pool = await _pool()
        await pool.stop_admission("b")
        await _idle_session(pool, "x/main", 200)
        await pool.activate("b")
        eid = await pool.acquire("x/main", frozenset(["a"]))
        pool.count_cached("x/main", 0)
        return eid, pool.metrics.kv_reprefill_tokens

    assert asyncio.run(main()) == ("b", 0)
