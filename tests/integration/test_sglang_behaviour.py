"""SGLang 0.5.21 as it behaves, on its contract fake (gyre.engines.sglang_fake): what waits for what
(the model-update lock, pauses), what kills the server (its scheduler's assertions), health probes
that generate, errors inside streams, prefix-matched aborts, `weight_versions` spans and the real
/get_model_info. Each test failed against the fake before it modelled the behaviour.

The fake runs with SGLANG_HEALTH_CHECK_TIMEOUT=2 (SGLang's default is 20 s), launched as Gyre
launches SGLang (gyre.engines.launch: `/health` without a generation)."""

import asyncio
import json

import aiohttp
import numpy as np
import pytest
import torch

from gyre.common.ports import PortReservation
from gyre.common.weight_group import join_weight_group
from gyre.engines import launch
from gyre.engines.client import EngineClient, EngineHTTPError, EngineStreamError
from gyre.engines.config import EngineConfig
from gyre.engines.launch import SGLangProcess
from gyre.models.checkpoint import save_checkpoint
from gyre.models.config import ModelConfig
from gyre.models.hf import hf_name
from gyre.models.transformer import init_weights
from gyre.proxy.config import ProxyConfig
from gyre.proxy.generation import Generation
from gyre.proxy.pool import EnginePool
from gyre.records.record import CallRecord

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=300,
    max_seq_len=1024,
)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
NUM_LONG = 400
LONG = {"max_new_tokens": NUM_LONG, "temperature": 1.0}
"""No stop ids: a call runs to its length, long after the test acts on its first chunk."""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The served model's HF directory and another set of weights for /update_weights_from_disk."""
    served, other = tmp_path_factory.mktemp("served"), tmp_path_factory.mktemp("other")
    save_checkpoint(served, MODEL, init_weights(MODEL, 5))
    save_checkpoint(other, MODEL, init_weights(MODEL, 6))
    return served, other


@pytest.fixture(scope="module")
def fake(dirs):
    proc = _started(dirs[0])
    yield proc
    proc.stop()


def _started(model_dir) -> SGLangProcess:
    """The fake serving `model_dir`, started as Gyre starts SGLang."""
    cfg = EngineConfig(
        backend="sglang",
        sglang_fake=True,
        model_path=str(model_dir),
        enable_hicache=False,
        weight_sync="disk",
        weight_version=0,
        startup_timeout_s=120,
    )
    proc = SGLangProcess(cfg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "2")
        proc.start()
    return proc


def _run(coro_fn, url: str):
    async def go():
        async with EngineClient(url, timeout_s=120) as c:
            return await coro_fn(c)

    return asyncio.run(go())


async def _stream(c: EngineClient, rid: str, started: asyncio.Event | None = None, params=LONG) -> dict:
    """A streamed call's last chunk; `started` is set once its first tokens arrived."""
    last = None
    async for chunk in c.generate_stream(PROMPT, params, rid=rid):
        if started is not None and chunk["output_ids"]:
            started.set()
        last = chunk
    return last


async def _next_version(c: EngineClient) -> int:
    return int((await c.model_info())["weight_version"]) + 1


async def _status(c: EngineClient, path: str) -> int:
    try:
        await c.get(path)
        return 200
    except EngineHTTPError as e:
        return e.status


def test_an_update_not_paused_waits_for_the_calls_in_flight(fake, dirs):
    """The write lock: the load is answered only after the call in flight ended (and that call
    was served by one version throughout); the next call gets the new one."""

    async def go(c: EngineClient):
        v, started, order = await _next_version(c), asyncio.Event(), []

        async def call() -> dict:
            out = await _stream(c, "w-1", started)
            order.append("call")
            return out

        task = asyncio.create_task(call())
        await started.wait()
        await c.update_weights_from_disk(str(dirs[1]), weight_version=v)
        order.append("update")
        return v, order, await task, await c.generate(PROMPT, {"max_new_tokens": 2})

    v, order, out, after = _run(go, fake.url)
    assert order == ["call", "update"]
    assert out["meta_info"]["weight_versions"] == [{"version": str(v - 1), "start": 0, "end": NUM_LONG}]
    assert after["meta_info"]["weight_version"] == str(v)


@pytest.mark.parametrize(
    "mode,flush,held_as", [("in_place", False, (1, 0)), ("retract", True, (0, 1))], ids=["in_place", "retract"]
)
def test_a_paused_call_continues_across_the_update_with_both_versions(fake, dirs, mode, flush, held_as):
    """retract and in_place keep the call: the update lands while it is held (the server not
    ready), it continues after /continue_generation and its final answer's `weight_versions` names
    both versions. in_place holds it running, with its KV (so the update must not flush the cache);
    retract puts it back in the queue without its KV, to be prefilled again (/v1/loads: running,
    waiting)."""

    async def go(c: EngineClient):
        v, started = await _next_version(c), asyncio.Event()
        task = asyncio.create_task(_stream(c, f"p-{mode}", started))
        await started.wait()
        await c.pause(mode)
        ready, load = await _status(c, "/ready"), (await c.loads())["loads"][0]
        await c.update_weights_from_disk(str(dirs[1]), weight_version=v, flush_cache=flush)
        held = not task.done()
        await c.resume()
        return (
            v,
            ready,
            (load["num_running_reqs"], load["num_waiting_reqs"]),
            held,
            await task,
            await _status(c, "/ready"),
        )

    v, ready_paused, queues, held, out, ready_after = _run(go, fake.url)
    spans = out["meta_info"]["weight_versions"]
    assert (ready_paused, queues, held, ready_after) == (503, held_as, True, 200)
    assert [s["version"] for s in spans] == [str(v - 1), str(v)] and spans[-1]["end"] == NUM_LONG
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["meta_info"]["weight_version"] == str(v)


def test_an_abort_pause_ends_the_calls_in_flight_and_holds_new_ones(fake):
    async def go(c: EngineClient):
        started = asyncio.Event()
        task = asyncio.create_task(_stream(c, "a-1", started))
        await started.wait()
        await c.pause("abort")
        aborted = await task
        late = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 2}, rid="a-2"))
        ready = await _status(c, "/ready")
        await c.resume()
        return aborted, ready, await late

    aborted, ready, late = _run(go, fake.url)
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort" and len(aborted["output_ids"]) < NUM_LONG
    assert ready == 503 and late["meta_info"]["finish_reason"]["type"] == "length"


def test_an_abort_matches_live_rids_by_prefix_and_drops_unknown_ones(fake):
    async def go(c: EngineClient):
        events = [asyncio.Event(), asyncio.Event()]
        tasks = [asyncio.create_task(_stream(c, rid, e)) for rid, e in zip(["x-1", "x-12"], events)]
        for e in events:
            await e.wait()
        await c.abort("x")  # no live call has this rid: the tokenizer manager drops it
        running = (await c.loads())["loads"][0]["num_running_reqs"]
        await c.abort("x-1")  # a live rid: every call whose rid starts with it
        return running, await asyncio.gather(*tasks)

    running, outs = _run(go, fake.url)
    assert running == 2
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]


def test_a_streamed_call_refused_is_http_200_with_an_error_chunk(fake):
    """SGLang validates a streamed call inside its stream: 200, `data: {"error"}`, `data: [DONE]`
    (a call that is not streamed: 400); the client raises it as the HTTP error it stands for."""
    too_long = {"max_new_tokens": MODEL.max_seq_len}

    async def go(c: EngineClient):
        body = {"input_ids": PROMPT, "sampling_params": too_long, "stream": True}
        async with aiohttp.ClientSession() as s, s.post(fake.url + "/generate", json=body) as r:
            raw = (r.status, await r.text())
        with pytest.raises(EngineStreamError) as streamed:
            await _stream(c, "e-1", params=too_long)
        with pytest.raises(EngineHTTPError) as plain:
            await c.generate(PROMPT, too_long)
        return raw, streamed.value, plain.value

    (status, text), streamed, plain = _run(go, fake.url)
    chunks = [line for line in text.splitlines() if line]
    assert status == 200 and len(chunks) == 2 and chunks[1] == "data: [DONE]"
    assert chunks[0].startswith('data: {"error":{"message":"input (8 tokens) + max_new_tokens')
    assert '"code":400' in chunks[0] and '"type":"invalid_request_error"' in chunks[0]
    assert streamed.status == 400 and "max_new_tokens" in streamed.body and plain.status == 400


def test_get_model_info_has_sglangs_fields_and_no_capacity(fake):
    info = _run(lambda c: c.model_info(), fake.url)
    same = _run(lambda c: c.get("/model_info"), fake.url)
    assert set(info) == {
        "model_path",
        "served_model_name",
        "tokenizer_path",
        "is_generation",
        "preferred_sampling_params",
        "weight_version",
        "load_format",
        "reasoning_parser",
        "tool_call_parser",
        "disaggregation_mode",
        "has_image_understanding",
        "has_audio_understanding",
        "model_type",
        "architectures",
    }
    assert info == same and "page_size" not in info and "max_total_num_tokens" not in info


async def _health_in_each_state(c: EngineClient, path: str) -> dict:
    """`path`'s status idle, paused (retract), released (and continued), and back."""
    out = {"idle": await _status(c, path)}
    await c.pause("retract")
    out["paused"] = await _status(c, path)
    await c.release_memory()
    await c.resume()
    out["released"] = await _status(c, path)
    await c.resume_memory()
    out["back"] = await _status(c, path)
    return out


def test_health_generates_unless_turned_off(fake, dirs, monkeypatch):
    """A health probe that generates (/health_generate; /health unless
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0) fails while paused (its probe waits) or released
    (nothing runs). Gyre's launch turns /health's generation off: 200 throughout."""
    generating = {"idle": 200, "paused": 503, "released": 503, "back": 200}
    assert _run(lambda c: _health_in_each_state(c, "/health_generate"), fake.url) == generating
    assert _run(lambda c: _health_in_each_state(c, "/health"), fake.url) == dict.fromkeys(generating, 200)
    monkeypatch.setattr(launch, "make_sglang_env", lambda cfg, base: base)  # SGLang's default environment
    proc = _started(dirs[0])
    try:
        assert _run(lambda c: _health_in_each_state(c, "/health"), proc.url) == generating
    finally:
        proc.stop()


def test_an_update_from_distributed_needs_its_session_and_health_fails_while_it_loads(fake):
    """/update_weights_from_distributed outside /begin_weight_update .. /end_weight_update: 400.
    Inside, not paused, it holds the write lock until the trainer's broadcast arrives: a health
    probe that generates waits behind it and fails; after the broadcast it passes."""
    weights = {hf_name(n): t for n, t in init_weights(MODEL, 7).items()}
    meta = (
        [*weights],
        [str(t.dtype).removeprefix("torch.") for t in weights.values()],
        [list(t.shape) for t in weights.values()],
    )

    async def go(c: EngineClient):
        name = "behaviour"
        with PortReservation() as port:  # until the group's store (rank 0, here) binds it
            group, _ = await asyncio.gather(
                asyncio.to_thread(join_weight_group, "127.0.0.1", port, 0, 2, name, "gloo"),
                c.init_weights_update_group("127.0.0.1", port, 1, 2, name, "gloo"),
            )
        with pytest.raises(EngineHTTPError) as outside:
            await c.update_weights_from_distributed(*meta, group_name=name)
        v = await _next_version(c)
        await c.begin_weight_update()
        update = asyncio.create_task(c.update_weights_from_distributed(*meta, weight_version=v, group_name=name))
        for _ in range(5):  # the first probe may reach the server before the update does
            loading = await _status(c, "/health_generate")
            if loading != 200:
                break

        def send() -> None:
            for work in [
                torch.distributed.broadcast(t, group=group, group_src=0, async_op=True) for t in weights.values()
            ]:
                work.wait()

        await asyncio.to_thread(send)
        reply = await update
        await c.end_weight_update()
        torch.distributed.destroy_process_group(group)
        return outside.value, loading, reply, await _status(c, "/health_generate"), v

    outside, loading, reply, after, v = _run(go, fake.url)
    assert outside.status == 400 and "between begin_weight_update() and end_weight_update()" in outside.body
    assert loading == 503 and reply["success"] and reply["message"].endswith(f"Weight version updated to {v}.")
    assert after == 200


@pytest.mark.parametrize("what", ["release", "flushing_update"])
def test_sglangs_scheduler_assertions_kill_a_server_with_calls_running(dirs, what):
    """/release_memory_occupation with a call running, or an update that flushes the cache while an
    in_place pause holds one: SGLang's scheduler asserts, and the whole server exits."""
    proc = _started(dirs[0])

    async def go(c: EngineClient) -> None:
        started = asyncio.Event()
        task = asyncio.create_task(_stream(c, "k-1", started))
        await started.wait()
        if what == "release":
            request = c.release_memory()
        else:
            await c.pause("in_place")
            request = c.update_weights_from_disk(str(dirs[1]), weight_version=1)
        with pytest.raises(aiohttp.ClientError):
            await request
        with pytest.raises((aiohttp.ClientError, EngineHTTPError)):
            await task

    try:
        _run(go, proc.url)
        assert proc.proc.wait(30) == 1
        want = "should be called only when server is idle" if what == "release" else "Cache flush failed"
        assert want in proc.log_tail()
    finally:
        proc.stop()


def test_gyres_release_pauses_first_so_a_call_still_running_does_not_kill_the_server(dirs):
    """SGLangProcess.release, through which the coordinator (coordinator/build.py) and a cell leader
    release an engine, with a call the proxy's drain missed still running: its abort pause ends the
    call, so the server is idle when /release_memory_occupation asserts it (a release alone kills
    it: the test above); /health, generation off as Gyre launches it, answers 200 while released,
    and the engine serves again after SGLangProcess.resume."""
    proc = _started(dirs[0])

    async def go(c: EngineClient):
        started = asyncio.Event()
        task = asyncio.create_task(_stream(c, "r-1", started))
        await started.wait()
        await proc.release(c)
        straggler, released = await task, await _status(c, "/health")
        await proc.resume(c)
        return straggler, released, await c.generate(PROMPT, {"max_new_tokens": 2})

    try:
        straggler, released, after = _run(go, proc.url)
        alive = proc.proc.poll() is None
    finally:
        proc.stop()
    assert alive and released == 200
    assert straggler["meta_info"]["finish_reason"]["type"] == "abort" and len(straggler["output_ids"]) < NUM_LONG
    assert after["meta_info"]["finish_reason"]["type"] == "length"


async def _decoding(c: EngineClient) -> None:
    """Return once the engine's one call has decoded output tokens (its KV outgrew the prompt)."""
    while (await c.loads())["loads"][0]["num_used_tokens"] <= len(PROMPT):
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("incremental", [True, False], ids=["streamed", "whole"])
def test_a_proxied_call_spanning_an_update_is_recorded_with_both_versions(fake, dirs, tmp_path, incremental):
    """The proxy's generation reads SGLang's final `weight_versions` into the call's versions: a
    call held by an in_place pause across an update is recorded with a span of each version,
    streamed or answered whole (whose `weight_version` names only the last)."""

    async def go():
        pool = EnginePool(ProxyConfig(records_dir=str(tmp_path)))
        await pool.register("e0", fake.url)
        prompt = np.asarray(PROMPT, np.int32)
        gen = Generation(pool, "s", "span-1", prompt, (json.dumps(PROMPT).encode(),), LONG, incremental=incremental)

        async def call() -> None:
            async for _ in gen.stream():
                pass

        task = asyncio.create_task(call())
        async with EngineClient(fake.url, timeout_s=120) as c:
            await _decoding(c)
            v = await _next_version(c)
            await c.pause("in_place")
            await c.update_weights_from_disk(str(dirs[1]), weight_version=v, flush_cache=False)
            await c.resume()
        await task
        await pool.close()
        return v, gen

    v, gen = asyncio.run(go())
    record = CallRecord.build(
        input_ids=PROMPT,
        output_ids=gen.output_ids,
        logprobs=gen.logprobs,
        versions=gen.versions,
        execution_id="x",
        call_id="c0",
        seq=0,
        agent_id="main",
        parent_agent_id=None,
        kind_hint="main",
        finish_reason=gen.finish,
    )
    (old, new) = record.version_spans
    assert (old.version, new.version) == (v - 1, v) and 0 < old.end == new.start < new.end == NUM_LONG
