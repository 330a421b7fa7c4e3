"""The engine HTTP contract (DESIGN.md), one suite parametrised by server: the builtin CPU engine
and SGLang's contract fake (gyre.engines.sglang_fake) here; a real SGLang server (dummy weights)
where a GPU and sglang exist.

Tests that need the exact weights (log-prob equivalence, weight updates from Gyre checkpoints,
KV export) run on the builtin engine only.
"""

import asyncio

import pytest
import torch

from gyre.engines.client import EngineHTTPError
from gyre.models.transformer import init_weights, sequence_logprobs
from tests.integration.engine_fixtures import MODEL, SEED, run, start_builtin, start_sglang, start_sglang_fake

PROMPT = list(range(10, 60))


@pytest.fixture(scope="module", params=["builtin", "sglang_fake", pytest.param("sglang", marks=pytest.mark.gpu)])
def server(request, tmp_path_factory):
    if request.param == "builtin":
        proc = start_builtin()
    elif request.param == "sglang_fake":
        # a released server's /health_generate fails at SGLang's health timeout (20 s by default)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "5")
            proc = start_sglang_fake(tmp_path_factory.mktemp("model"))
    else:
        proc = start_sglang()
    proc.kind = request.param
    yield proc
    proc.stop()


def builtin_only(server):
    if server.kind != "builtin":
        pytest.skip("needs the builtin engine's known weights")


def test_generate_fields_and_logprob_shapes(server):
    out = run(lambda c: c.generate(PROMPT, {"max_new_tokens": 5, "temperature": 0}, rid="fields"), server.url)
    assert set(out) >= {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "fields" and meta["finish_reason"]["type"] == "length"
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 5 == len(out["output_ids"])
    assert "cached_tokens" in meta and "weight_version" in meta
    lps = meta["output_token_logprobs"]
    assert len(lps) == 5 and all(
        len(e) == 3 and e[2] is None and e[1] == t and e[0] <= 0 for e, t in zip(lps, out["output_ids"])
    )


def test_stop_token_ends_with_finish_type_stop(server):
    first = run(lambda c: c.generate(PROMPT, {"max_new_tokens": 3, "temperature": 0}), server.url)["output_ids"]
    out = run(
        lambda c: c.generate(PROMPT, {"max_new_tokens": 3, "temperature": 0, "stop_token_ids": [first[1]]}), server.url
    )
    assert out["meta_info"]["finish_reason"]["type"] == "stop" and out["output_ids"][-1] == first[1]


def test_greedy_is_deterministic_and_seeded_sampling_reproducible(server):
    async def body(c):
        greedy = [await c.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0}) for _ in range(2)]
        params = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 1234}
        # the same seed alone and batched with 7 other requests: the same tokens
        alone = await c.generate(PROMPT, params)
        crowd = await asyncio.gather(
            *[c.generate(PROMPT[i:], {**params, "sampling_seed": i}) for i in range(1, 8)], c.generate(PROMPT, params)
        )
        other = await c.generate(PROMPT, {**params, "sampling_seed": 99})
        return greedy, alone, crowd[-1], other

    greedy, alone, batched, other = run(body, server.url)
    assert greedy[0]["output_ids"] == greedy[1]["output_ids"]
    assert alone["output_ids"] == batched["output_ids"]
    assert other["output_ids"] != alone["output_ids"]


def test_engine_logprobs_equal_a_full_sequence_forward(server):
    builtin_only(server)
    weights = init_weights(MODEL, SEED)

    async def body(c):
        reqs = [
            c.generate(PROMPT[: 20 + 4 * i], {"max_new_tokens": 12, "temperature": t, "sampling_seed": i})
            for i, t in enumerate([0.0, 1.0, 0.7, 1.0, 1.3, 1.0])
        ]
        return await asyncio.gather(*reqs)

    outs = run(body, server.url)
    worst = 0.0
    for i, (out, t) in enumerate(zip(outs, [0.0, 1.0, 0.7, 1.0, 1.3, 1.0])):
        prompt = PROMPT[: 20 + 4 * i]
        ref = sequence_logprobs(MODEL, weights, prompt + out["output_ids"], temperature=t)[len(prompt) - 1 :]
        got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
        worst = max(worst, float((got - ref).abs().max()))
    assert worst <= 1e-5


def test_repeated_prefix_reports_cached_tokens(server):
    async def body(c):
        warm = await c.generate(PROMPT + [7] * 40, {"max_new_tokens": 0})  # prefill only
        return warm, await c.generate(PROMPT + [7] * 40 + [1, 2, 3], {"max_new_tokens": 2})

    warm, again = run(body, server.url)
    assert warm["meta_info"]["completion_tokens"] == 0 and warm["meta_info"]["finish_reason"]["type"] == "length"
    assert again["meta_info"]["cached_tokens"] > 0


async def _first_chunk_then(c, rid, action, max_new=2000):
    """Start a long streamed generation; after its first chunk run `action(c)`; return (action result, last chunk)."""
    result, last = None, None
    async for chunk in c.generate_stream(
        PROMPT, {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}, rid=rid
    ):
        if last is None:
            result = await action(c)
        last = chunk
    return result, last


def test_abort_returns_partial_output(server):
    _, last = run(lambda c: _first_chunk_then(c, "victim", lambda c: c.abort("victim")), server.url)
    meta = last["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < 2000
    assert len(last["output_ids"]) == meta["completion_tokens"]


def test_pause_in_place_holds_requests_until_continue(server):
    # A request sent while paused waits: in the builtin engine's queue; in SGLang before its
    # scheduler (its tokenizer manager holds /generate while paused: srt/managers/tokenizer_manager.py)
    waiting = 1 if server.kind == "builtin" else 0

    async def body(c):
        async def pause_and_look(c):
            await c.pause("in_place")
            before = (await c.loads())["loads"][0]
            late = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 2}))  # queued while paused
            for _ in range(200):  # until the engine holds it (10 s at most)
                if (still := (await c.loads())["loads"][0])["num_waiting_reqs"] == waiting:
                    break
                await asyncio.sleep(0.05)
            await c.resume()
            return before, still, late.done(), await late

        return await _first_chunk_then(c, "held", pause_and_look, max_new=150)

    (before, still, late_done_while_paused, late), last = run(body, server.url)
    assert before["num_running_reqs"] == 1 and not late_done_while_paused
    assert (still["num_running_reqs"], still["num_waiting_reqs"]) == (1, waiting)
    assert last["meta_info"]["finish_reason"]["type"] == "length" and last["meta_info"]["completion_tokens"] == 150
    assert late["meta_info"]["completion_tokens"] == 2


def test_pause_abort_and_retract_modes(server):
    async def body(c):
        aborted = await _first_chunk_then(c, "a", lambda c: c.pause("abort"), max_new=500)
        await c.resume()

        async def retract(c):
            await c.pause("retract")
            loads = (await c.loads())["loads"][0]
            await c.flush_cache()  # allowed: retracted requests hold no KV
            await c.resume()
            return loads

        retracted = await _first_chunk_then(c, "r", retract, max_new=150)
        return aborted, retracted

    (_, a_last), (loads, r_last) = run(body, server.url)
    assert a_last["meta_info"]["finish_reason"]["type"] == "abort"
    assert loads["num_running_reqs"] == 0 and loads["num_waiting_reqs"] == 1
    assert r_last["meta_info"]["finish_reason"]["type"] == "length" and r_last["meta_info"]["completion_tokens"] == 150


def test_flush_cache_refused_while_busy(server):
    async def try_flush(c):
        try:
            await c.flush_cache()
            return 200
        except EngineHTTPError as e:
            return e.status
        finally:
            await c.abort("busy")

    status, _ = run(lambda c: _first_chunk_then(c, "busy", try_flush), server.url)
    assert status == 400
    out = run(lambda c: c.flush_cache(), server.url)  # SGLang answers 200 with text, the builtin engine JSON
    assert out["success"] if isinstance(out, dict) else out.startswith("Cache flushed.")


def test_weight_update_from_disk_bumps_version_and_changes_outputs(server, tmp_path):
    builtin_only(server)
    from gyre.models.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "seed1", MODEL, init_weights(MODEL, 1))
    save_checkpoint(tmp_path / "seed0", MODEL, init_weights(MODEL, SEED))

    async def body(c):
        v0 = (await c.model_info())["weight_version"]
        before = await c.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0})
        up = await c.update_weights_from_disk(str(tmp_path / "seed1"))
        after = await c.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0})
        v1 = (await c.model_info())["weight_version"]
        await c.update_weights_from_disk(str(tmp_path / "seed0"), weight_version=0)
        return v0, before, up, after, v1

    v0, before, up, after, v1 = run(body, server.url)
    # Integers on the builtin engine; SGLang reports the same numbers as strings (EngineClient parses them).
    assert int(v1) == int(up["weight_version"]) == int(v0) + 1 and int(after["meta_info"]["weight_version"]) == int(v1)
    assert after["output_ids"] != before["output_ids"]
    assert after["meta_info"]["cached_tokens"] == 0  # KV of old weights is never reused


def test_update_mid_generation_reports_per_span_versions(server):
    builtin_only(server)
    import base64

    from safetensors.torch import save as save_safetensors

    blob = base64.b64encode(save_safetensors(init_weights(MODEL, SEED))).decode()

    async def update(c):
        return await c.update_weights_from_tensor(weight_version=5, serialized_named_tensors=[blob])

    up, last = run(lambda c: _first_chunk_then(c, "spans", update, max_new=300), server.url)
    spans = last["meta_info"]["weight_version_spans"]
    assert up["weight_version"] == 5 == spans[-1]["weight_version"] and len(spans) == 2
    assert spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 300


def test_a_weight_version_that_is_not_an_integer_is_400_and_changes_nothing(server):
    builtin_only(server)
    import base64

    from safetensors.torch import save as save_safetensors

    blob = base64.b64encode(save_safetensors(init_weights(MODEL, SEED))).decode()

    async def body(c):
        before = (await c.model_info())["weight_version"]
        try:
            await c.update_weights_from_tensor(weight_version="mid", serialized_named_tensors=[blob])
        except EngineHTTPError as e:
            return before, e, (await c.model_info())["weight_version"]

    before, err, after = run(body, server.url)
    assert (
        err.status == 400
        and "weight_version must be an integer" in err.body
        and isinstance(before, int)
        and after == before
    )


def test_update_from_a_published_buffer_over_mooncake(server):
    """The trainer's path: pack weights into a registered buffer, let the engine read it."""
    builtin_only(server)
    from gyre.transfer import TransferEndpoint

    trainer = TransferEndpoint()
    descriptor, buf = trainer.publish_tensors(init_weights(MODEL, 2))
    try:

        async def body(c):
            before = await c.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0})
            up = await c.update_weights_from_tensor(weight_version=2, load_format="gyre_transfer", **descriptor)
            after = await c.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0})
            await c.update_weights_from_tensor(
                weight_version=0, load_format="gyre_transfer", **trainer.publish_tensors(init_weights(MODEL, SEED))[0]
            )
            return before, up, after

        before, up, after = run(body, server.url)
    finally:
        trainer.close()
    ref = sequence_logprobs(MODEL, init_weights(MODEL, 2), PROMPT + after["output_ids"])[len(PROMPT) - 1 :]
    got = torch.tensor([e[0] for e in after["meta_info"]["output_token_logprobs"]])
    assert up["weight_version"] == 2 == after["meta_info"]["weight_version"]
    assert after["output_ids"] != before["output_ids"] and float((got - ref).abs().max()) <= 1e-5


def test_concurrent_requests_share_engine_steps(server):
    """Continuous batching: 8 requests of 16 tokens take about 16 steps together, not 128."""
    builtin_only(server)

    async def body(c):
        steps0 = (await c.loads())["loads"][0]["num_steps"]
        outs = await asyncio.gather(
            *[c.generate(PROMPT[i:], {"max_new_tokens": 16, "ignore_eos": True}) for i in range(8)]
        )
        return (await c.loads())["loads"][0]["num_steps"] - steps0, outs

    steps, outs = run(body, server.url)
    assert all(o["meta_info"]["completion_tokens"] == 16 for o in outs) and steps < 48


def test_release_and_resume_memory(server):
    async def body(c):
        before = await c.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0})
        await c.release_memory()
        try:
            await c.health_generate()
            healthy_while_released = True
        except EngineHTTPError:
            healthy_while_released = False
        await c.resume_memory()
        await c.health_generate()
        after = await c.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0})
        return before, healthy_while_released, after

    before, healthy_while_released, after = run(body, server.url)
    assert not healthy_while_released and after["output_ids"] == before["output_ids"]


def test_health_model_info_and_loads(server):
    async def body(c):
        return await c.health(), await c.model_info(), await c.loads()

    ok, info, loads = run(body, server.url)
    assert ok and "weight_version" in info
    assert {"num_running_reqs", "num_waiting_reqs"} <= set(loads["loads"][0])


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"{not json", id="malformed-json"),
        pytest.param(b'{"sampling_params": {"max_new_tokens": 2}}', id="missing-input"),
        pytest.param(b'{"input_ids": [1, 100000]}', id="id-outside-vocab"),
        pytest.param(b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 100000}}', id="beyond-context"),
    ],
)
def test_bad_input_is_400_and_the_server_stays_up(server, raw):
    async def body(c):
        try:
            await c._request("POST", "/generate", raw=raw)
        except EngineHTTPError as e:
            return e, await c.health()
        return None, await c.health()

    err, healthy = run(body, server.url)
    assert err is not None and err.status == 400 and err.body and healthy


def test_unknown_fields_are_ignored(server):
    out = run(
        lambda c: c.post(
            "/generate",
            {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 2, "frobnicate": 1},
                "lora_path": None,
                "no_such_field": [1],
            },
        ),
        server.url,
    )
    assert out["meta_info"]["completion_tokens"] == 2


def test_text_input_is_tokenized_by_the_engine(server):
    builtin_only(server)  # SGLang's count depends on its model's tokenizer
    out = run(lambda c: c.post("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 1}}), server.url)
    assert out["meta_info"]["prompt_tokens"] == 5


def test_a_client_that_disconnects_frees_its_slot(server):
    async def body(c):
        async for _ in c.generate_stream(PROMPT, {"max_new_tokens": 2000, "ignore_eos": True}, rid="gone"):
            break  # leaving the stream closes the connection
        for _ in range(100):
            if (await c.loads())["loads"][0]["num_running_reqs"] == 0:
                return True
            await asyncio.sleep(0.05)
        return False

    assert run(body, server.url)


def test_nccl_weight_updates_point_to_the_mooncake_path(server):
    builtin_only(server)

    async def body(c):
        try:
            await c.post("/update_weights_from_distributed", {"names": []})
        except EngineHTTPError as e:
            return e

    err = run(body, server.url)
    assert err.status == 400 and "gyre_transfer" in err.body


def test_an_engine_killed_before_its_cleanup_leaves_no_files_once_stopped():
    """An engine's files (log, port file, its TMPDIR: the weights a release spills) are its parent's
    private directory, removed at `stop` even when the engine died by SIGKILL and cleaned nothing."""
    proc = start_builtin()
    try:
        run(lambda c: c.release_memory(), proc.url)  # spills its in-memory weights to its scratch
        files = proc.dir
        spilled = [p for p in files.rglob("*") if p.is_file() and p.name != "log"]
        assert spilled and all(files in p.parents for p in spilled)
        proc.kill()
        assert files.is_dir()
    finally:
        proc.stop()
    assert not files.exists() and proc.log_tail() == "(no log)"
