"""The engine model (SGLang + HiCache): slots only during model calls, LRU KV, offload, reload or recompute."""

from dataclasses import replace

import pytest

from gyre.scheduler.config import SchedulerConfig
from gyre.sim.engine import Simulation
from gyre.sim.kv import GPU, HOST, NONE, CellEngine, HostTier
from tests.unit.test_sim import PRESET, PROFILE


class S:
    """A session as the engine sees it."""

    def __init__(self):
        self.eng, self.where, self.kv, self.call = None, NONE, 0.0, 0


def engine(kv_cap=100.0, batch_cap=4, host_cap=1000.0):
    # 10 tok/s per session; prefill 10 tok/s, reload 100 tok/s: costs are easy to read off
    return CellEngine(
        kv_cap,
        batch_cap,
        gen_tok_s=1000.0,
        session_tok_s=10.0,
        prefill_tok_s=10.0,
        load_tok_s=100.0,
        host=HostTier(host_cap),
    )


def test_a_session_in_a_tool_call_holds_no_slot_and_its_kv_stays_cached():
    e = engine(batch_cap=1)
    a, b = S(), S()
    assert e.start(a, 0.0, 0, 40, tokens=10) == 1.0
    assert e.start(b, 0.5, 0, 40, tokens=10) is None  # the one slot is busy
    assert e.start(b, 1.0, 0, 40, tokens=10) == 2.0  # a's call ended: a is in a tool call
    assert a.where == GPU and e.kv_used == 80
    assert e.start(a, 5.0, 40, 50, tokens=10) == 6.0  # cached: no reload, no prefill


def test_lru_eviction_offloads_to_the_host_tier_and_reload_costs_bandwidth():
    e = engine(kv_cap=100.0)
    a, b, c = S(), S(), S()
    e.start(a, 0.0, 0, 40, 10)
    e.start(b, 2.0, 0, 40, 10)
    e.start(c, 4.0, 0, 40, 10)  # needs room: a (least recently used) goes to the host tier
    assert (a.where, b.where, c.where) == (HOST, GPU, GPU) and e.host.used == 40
    assert e.start(a, 10.0, 40, 50, 10) == pytest.approx(10.0 + 40 / 100 + 1.0)  # reload, then decode
    assert e.load_tokens == 40 and e.prefill_tokens == 0
    assert b.where == HOST and e.host.used == 40  # a left the tier; b was least recently used


def test_without_room_in_the_host_tier_evicted_kv_is_recomputed():
    e = engine(kv_cap=100.0, host_cap=0.0)
    a, b, c = S(), S(), S()
    for t, s in ((0.0, a), (2.0, b), (4.0, c)):
        e.start(s, t, 0, 40, 10)
    assert a.where == NONE
    assert e.start(a, 10.0, 40, 50, 10) == pytest.approx(10.0 + 40 / 10 + 1.0)  # prefill, then decode
    assert e.prefill_tokens == 40


def test_busy_contexts_must_fit_on_the_gpu():
    e = engine(kv_cap=100.0)
    a, b = S(), S()
    e.start(a, 0.0, 0, 70, 10)
    assert e.start(b, 0.5, 0, 40, 10) is None  # a's context is in use, not evictable
    assert e.start(b, 1.0, 0, 40, 10) is not None and a.where == HOST


def test_vacating_offloads_every_session_and_returns_the_waiters():
    e = engine(batch_cap=1)
    a, b = S(), S()
    e.start(a, 0.0, 0, 40, 10)
    assert e.start(b, 0.1, 0, 40, 10) is None
    e.waiters.append(b)
    assert list(e.vacate([a, b])) == [b]
    assert a.where == HOST and e.kv_used == 0 and not e.busy
    lost = engine()
    c = S()
    lost.start(c, 0.0, 0, 40, 10)
    lost.vacate([c], lost=True)
    assert c.where == NONE


def test_finished_sessions_free_their_kv_wherever_it_lives():
    e = engine(kv_cap=100.0)
    a, b, c = S(), S(), S()
    for t, s in ((0.0, a), (2.0, b), (4.0, c)):
        e.start(s, t, 0, 40, 10)
    e.release(a)
    e.release(b)
    assert e.host.used == 0 and e.kv_used == 40 and a.where == b.where == NONE


def test_colocate_parks_sessions_through_the_same_offload_tier():
    # Its cells leave rollout through the same hand-off as elastic's: reloaded from a roomy tier,
    # recomputed without one.
    sched = SchedulerConfig(mode="colocate", staleness=1)
    none = Simulation(PROFILE, replace(PRESET, host_kv_tokens_per_node=0), sched, num_steps=3, tick_s=5.0).run()
    roomy = Simulation(
        PROFILE, replace(PRESET, host_kv_tokens_per_node=50_000_000), sched, num_steps=3, tick_s=5.0
    ).run()
    assert none.recompute_tokens > 0 and none.reload_tokens == 0
    assert roomy.recompute_tokens == 0 and roomy.reload_tokens > 0


def test_every_new_prompt_token_is_prefilled_even_with_the_kv_cached():
    e = engine()
    a = S()
    e.start(a, 0.0, 0, 40, tokens=10)
    assert e.start(a, 5.0, 40, 50, tokens=10, prompt=20) == pytest.approx(5.0 + 20 / 10 + 1.0)
    assert e.prefill_tokens == 20 and e.recompute_tokens == 0


def test_prefill_and_decode_share_the_cell_throughput():
    # 100 tok/s of decode in all; each call decodes 10 tokens after prefilling 10 prompt tokens
    # (10 tok/s): 10 + 10 x 100/10 = 110 decode-equivalent tokens. However many calls start, the
    # reservations never exceed the throughput, so the work done by time t is at most 100 t.
    e = CellEngine(
        1e6, 1000, gen_tok_s=100.0, session_tok_s=10.0, prefill_tok_s=10.0, load_tok_s=100.0, host=HostTier(0.0)
    )
    ends = []
    for _ in range(20):
        end = e.start(S(), 0.0, 0, 1, tokens=10, prompt=10)
        assert e.reserved <= 100.0 + 1e-9
        if end is not None:
            ends.append(end)
    assert ends and all(110 * (k + 1) / 100 <= end + 1e-9 for k, end in enumerate(sorted(ends)))
    assert e.start(S(), 0.0, 0, 1, tokens=10) is None  # nothing left: the call waits
