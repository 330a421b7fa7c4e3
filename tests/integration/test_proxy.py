"""The proxy over real builtin engines (scripted policy): both APIs, bad input, drains and crashes
under concurrent sessions, no-engine waits, and records surviving a SIGKILL of the proxy."""

import asyncio
import json
import time

import aiohttp
import numpy as np
import pytest
from proxy_fixtures import anthropic_call, http, new_execution, openai_call, start_engine, start_proxy

from gyre.proxy.config import ProxyConfig
from gyre.records.io import read_records
from gyre.trajectory.tree import build_call_tree

FILLER = "Working through the task step by step; " * 4
RULES = [
    {
        "match": "tool_response|please|step",
        "emit": FILLER + '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>',
    }
]
A_TOOLS = [
    {
        "name": "bash",
        "description": "run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]
O_TOOLS = [
    {
        "type": "function",
        "function": {"name": "bash", "description": "run a command", "parameters": A_TOOLS[0]["input_schema"]},
    }
]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engines")
    # from this thread, one by one: an engine dies with the thread that spawned it (gyre.common.spawn)
    procs = [start_engine(tmp, RULES, name=f"e{i}") for i in range(3)]
    yield procs
    for p in procs:
        p.stop()


async def anthropic_session(s, url, key, turns: int, stream: bool) -> int:
    body = {
        "model": "gyre",
        "max_tokens": 400,
        "stream": stream,
        "system": "You are a test agent.",
        "tools": A_TOOLS,
        "messages": [{"role": "user", "content": "please take a step"}],
    }
    for _ in range(turns):
        msg = await anthropic_call(s, url, key, body)
        use = [b for b in msg["content"] if b["type"] == "tool_use"]
        assert msg["stop_reason"] == "tool_use" and use[0]["input"] == {"command": "ls"}, msg
        assert msg["content"][0]["text"] == FILLER.strip()
        assert not stream or msg["num_input_json_deltas"] > 1  # the input streamed as its tokens came
        body["messages"] += [
            {"role": "assistant", "content": msg["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0]["id"], "content": "a.txt"}]},
        ]
    return turns


async def openai_session(s, url, key, turns: int, stream: bool) -> int:
    body = {
        "model": "gyre",
        "stream": stream,
        "tools": O_TOOLS,
        "messages": [{"role": "user", "content": "please take a step"}],
    }
    for _ in range(turns):
        choice = await openai_call(s, url, key, body)
        calls = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and json.loads(calls[0]["function"]["arguments"]) == {
            "command": "ls"
        }
        assert not stream or choice["message"]["num_argument_deltas"] > 1
        body["messages"] += [
            {"role": "assistant", "content": choice["message"]["content"], "tool_calls": calls},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": "a.txt"},
        ]
    return turns


def assert_clean_chain(path, turns: int):
    """Each call of the (single-agent) execution continues the previous one token for token."""
    records, stats = read_records(path)
    assert stats.num_torn == 0 and not stats.invalid and len(records) == turns
    tree = build_call_tree(records)
    assert tree.missing_seqs == []
    for i, node in enumerate(tree.nodes[1:], start=1):
        assert node.parent == i - 1 and node.shared >= tree.nodes[i - 1].end, f"call {i} does not extend call {i - 1}"
    return records


def test_both_apis_stream_and_plain(engines, tmp_path):
    proxy = start_proxy(tmp_path, [engines[0].url])
    try:
        keys = {n: new_execution(proxy, n) for n in ("a-stream", "a-plain", "o-stream", "o-plain")}

        async def main():
            async with aiohttp.ClientSession() as s:
                await asyncio.gather(
                    anthropic_session(s, proxy.url, keys["a-stream"], 2, True),
                    anthropic_session(s, proxy.url, keys["a-plain"], 2, False),
                    openai_session(s, proxy.url, keys["o-stream"], 2, True),
                    openai_session(s, proxy.url, keys["o-plain"], 2, False),
                )

        asyncio.run(main())
        for name in keys:
            records = assert_clean_chain(tmp_path / "records" / f"{name}.jsonl", 2)
            assert records[1].hints["reused_turns"] == 1 and records[1].hints["retokenized_turns"] == 0
            assert all(r.output_ids.size == r.logprobs.size > 0 and r.finish_reason == "stop" for r in records)
        assert http(proxy.url + "/api/hello", "HEAD")[0] == 200
        # Claude Code re-sends a broken stream's body without streaming: marked as a retry.
        key = new_execution(proxy, "retry")
        body = {"model": "gyre", "max_tokens": 30, "stream": True, "messages": [{"role": "user", "content": "please"}]}
        assert http(proxy.url + "/v1/messages", "POST", body, headers={"x-api-key": key})[0] == 200
        assert http(proxy.url + "/v1/messages", "POST", {**body, "stream": False}, headers={"x-api-key": key})[0] == 200
        records = read_records(tmp_path / "records" / "retry.jsonl")[0]
        assert [r.is_retry for r in records] == [False, True]
        status, counted = http(proxy.url + "/v1/messages/count_tokens", "POST", body, headers={"x-api-key": key})
        assert status == 200 and counted["input_tokens"] == records[0].input_ids.size
    finally:
        proxy.stop()


def test_bad_input_answers_4xx_in_each_format(engines, tmp_path):
    proxy = start_proxy(tmp_path, [engines[0].url], context_len=2000)
    try:
        key = new_execution(proxy, "bad")
        good_a = {"model": "gyre", "max_tokens": 50, "messages": [{"role": "user", "content": "please"}]}
        good_o = {"model": "gyre", "messages": [{"role": "user", "content": "please"}]}
        a, o = proxy.url + "/v1/messages", proxy.url + "/v1/chat/completions"
        ha, ho = {"x-api-key": key}, {"Authorization": f"Bearer {key}"}
        tool_use = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash", "input": {}}]}
        cases = [  # (url, headers, body or raw bytes, status, message fragment)
            (a, ha, b"{not json", 400, "malformed JSON"),
            (o, ho, b"{not json", 400, "malformed JSON"),
            (a, ha, {**good_a, "max_tokens": "ten"}, 400, "max_tokens: expected an integer"),
            (o, ho, {**good_o, "messages": "hi"}, 400, "messages: expected an array"),
            (a, ha, {**good_a, "model": "nope"}, 404, "'nope' is not served"),
            (o, ho, {**good_o, "model": "nope"}, 404, "does not exist"),
            (a, ha, {**good_a, "tools": [{"name": "x", "input_schema": "string"}]}, 400, "input_schema"),
            (
                o,
                ho,
                {**good_o, "tools": [{"type": "function", "function": {"name": "x", "parameters": 5}}]},
                400,
                "parameters",
            ),
            (a, ha, {**good_a, "messages": [{"role": "user", "content": "x" * 3000}]}, 400, "prompt is too long"),
            (o, ho, {**good_o, "messages": [{"role": "user", "content": "x" * 3000}]}, 400, "prompt is too long"),
            (
                a,
                ha,
                {
                    **good_a,
                    "messages": [
                        {"role": "user", "content": "q"},
                        tool_use,
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "r"}]},
                    ],
                },
                400,
                "'t9' does not match",
            ),
            (
                o,
                ho,
                {**good_o, "messages": [{"role": "tool", "tool_call_id": "c9", "content": "r"}]},
                400,
                "'c9' does not answer",
            ),
            (a, {"x-api-key": "gyre-unknown"}, good_a, 401, "unknown or revoked"),
            (o, {}, good_o, 401, "unknown or revoked"),
        ]

        def send_bad_requests():
            for url, headers, body, status, fragment in cases:
                raw = body if isinstance(body, bytes) else None
                got, out = http(url, "POST", None if raw else body, headers=headers, raw=raw)
                assert got == status, (url, body, out)
                message = out["error"]["message"]
                assert fragment in message, (fragment, message)
                if url == a:
                    assert out["type"] == "error" and out["error"]["type"].endswith("_error")
                else:
                    assert set(out["error"]) == {"message", "type", "param", "code"}

        async def main():  # another execution's session runs meanwhile, unaffected
            async with aiohttp.ClientSession() as s:
                await asyncio.gather(
                    asyncio.to_thread(send_bad_requests), anthropic_session(s, proxy.url, other, 3, True)
                )

        other = new_execution(proxy, "bystander")
        asyncio.run(main())
        assert_clean_chain(tmp_path / "records" / "bystander.jsonl", 3)
        # The proxy stayed up and serves the same execution; nothing was recorded for refusals.
        assert http(a, "POST", good_a, headers=ha)[0] == 200
        records, _ = read_records(tmp_path / "records" / "bad.jsonl")
        assert [r.seq for r in records] == [0]
        # The key may also come as a custom header (Claude Code's ANTHROPIC_CUSTOM_HEADERS).
        assert http(a, "POST", good_a, headers={"x-gyre-key": key})[0] == 200
        # Revocation: the key stops working; the admin API needs its token.
        assert http(proxy.url + "/admin/executions/bad", "DELETE", token=proxy.admin_token)[0] == 200
        assert http(a, "POST", good_a, headers=ha)[0] == 401
        assert http(proxy.url + "/admin/metrics", token="wrong")[0] == 401
        assert http(proxy.url + "/admin/engines/zz/drain", "POST", token=proxy.admin_token)[0] == 404
    finally:
        proxy.stop()


def test_responses_api_answers_parse_with_the_openai_sdk(engines, tmp_path):
    """`responses.create` and `responses.stream` of the official SDK read the proxy's answers, and a
    conversation continued with the output items reuses the model's tokens (a clean record chain)."""
    import openai

    proxy = start_proxy(tmp_path, [engines[0].url])
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=new_execution(proxy, "resp"), max_retries=0)
        tools = [
            {
                "type": "function",
                "name": "bash",
                "description": "run a command",
                "parameters": A_TOOLS[0]["input_schema"],
            }
        ]
        items = [{"role": "user", "content": "please take a step"}]
        first = client.responses.create(
            model="gyre", input=items, tools=tools, max_output_tokens=400, instructions="Be brief."
        )
        calls = [o for o in first.output if o.type == "function_call"]
        assert first.status == "completed" and first.output_text == FILLER.strip() and first.usage.input_tokens > 0
        assert len(calls) == 1 and calls[0].name == "bash" and json.loads(calls[0].arguments) == {"command": "ls"}
        items += [o.model_dump(exclude_none=True) for o in first.output]
        items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "a.txt"})
        with client.responses.stream(
            model="gyre", input=items, tools=tools, max_output_tokens=400, instructions="Be brief."
        ) as s:
            kinds = [e.type for e in s]
            final = s.get_final_response()
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert (
            kinds.count("response.output_text.delta") > 1 and kinds.count("response.function_call_arguments.delta") > 1
        )
        (call,) = [o for o in final.output if o.type == "function_call"]
        assert final.output_text == FILLER.strip() and json.loads(call.arguments) == {"command": "ls"}
        assert_clean_chain(tmp_path / "records" / "resp.jsonl", 2)
        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            client.responses.create(model="gyre", input="x", previous_response_id=first.id)
        with pytest.raises(openai.BadRequestError, match="does not answer a function_call"):
            client.responses.create(
                model="gyre", input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}]
            )
    finally:
        proxy.stop()


def test_workers_pin_executions_and_share_engines(engines, tmp_path):
    """Two proxy workers over one records directory: each execution is served and recorded by the
    worker it is pinned to only; engine changes reach every worker."""
    from gyre.proxy.admin import ProxyAdminError
    from gyre.proxy.workers import ProxyWorkers

    cfg = ProxyConfig(
        records_dir=str(tmp_path / "records"), engines=[engines[0].url], model_names=["gyre"], health_interval_s=0.5
    )
    workers = ProxyWorkers(cfg, 2).start()

    async def admin(method: str, *args):
        async with workers.admin() as a:
            return await getattr(a, method)(*args)

    try:
        made = {eid: asyncio.run(admin("create_execution", eid)) for eid in ("w-a", "w-b", "w-c", "w-d")}
        assert {m["url"] for m in made.values()} == set(workers.urls)  # these ids land on both workers
        body = {"model": "gyre", "max_tokens": 50, "messages": [{"role": "user", "content": "please"}]}
        for eid, m in made.items():
            other = next(u for u in workers.urls if u != m["url"])
            assert http(m["url"] + "/v1/messages", "POST", body, headers={"x-api-key": m["api_key"]})[0] == 200
            assert http(other + "/v1/messages", "POST", body, headers={"x-api-key": m["api_key"]})[0] == 401
            status, out = http(other + "/admin/executions", "POST", {"execution_id": eid}, token=workers.admin_token)
            assert status == 400 and "pinned to proxy worker" in out["error"]["message"]
            (record,), _ = read_records(tmp_path / "records" / f"{eid}.jsonl")
            assert record.seq == 0
        assert [r["result"] for r in asyncio.run(admin("engine_op", "e0", "stop_admission"))] == [None, None]
        metrics = asyncio.run(admin("metrics"))
        assert metrics["num_calls"] == 4 and len(metrics["executions"]) == 4
        assert [(e["engine_id"], e["status"], e["num_sessions"]) for e in metrics["engines"]] == [("e0", "closing", 4)]
        with pytest.raises(ProxyAdminError, match="404"):
            asyncio.run(admin("engine_op", "nope", "drain"))
    finally:
        workers.stop()


def test_stop_admission_keeps_old_sessions_and_metrics_show_load(engines, tmp_path):
    """Phase 1 of a cell leaving rollout: a closing engine serves its sessions, takes no new ones."""
    proxy = start_proxy(tmp_path, [engines[0].url, engines[1].url])
    try:
        keys = {name: new_execution(proxy, name) for name in ("old", "new")}
        body = {
            "model": "gyre",
            "max_tokens": 400,
            "tools": A_TOOLS,
            "messages": [{"role": "user", "content": "please take a step"}],
        }

        def call(name: str) -> str:
            status, out = http(proxy.url + "/v1/messages", "POST", body, headers={"x-api-key": keys[name]})
            assert status == 200, out
            records, _ = read_records(tmp_path / "records" / f"{name}.jsonl")
            return records[-1].engine_id

        first = call("old")
        other = {"e0": "e1", "e1": "e0"}[first]
        status, out = http(f"{proxy.url}/admin/engines/{first}/stop_admission", "POST", token=proxy.admin_token)
        assert status == 200 and {e["engine_id"]: e["status"] for e in out["engines"]}[first] == "closing"
        assert call("new") == other and call("old") == first  # new sessions elsewhere, the old one stays
        status, m = http(proxy.url + "/admin/metrics", token=proxy.admin_token)
        assert status == 200 and {e["engine_id"]: e["num_sessions"] for e in m["engines"]} == {first: 1, other: 1}
        assert m["executions"] == {
            "old": {"num_inflight": 0, "has_session": True},
            "new": {"num_inflight": 0, "has_session": True},
        }
        assert all(e["num_inflight"] == 0 and e["weight_version"] == 0 for e in m["engines"])
        http(proxy.url + "/admin/executions/new", "DELETE", token=proxy.admin_token)
        status, m = http(proxy.url + "/admin/metrics", token=proxy.admin_token)
        assert set(m["executions"]) == {"old"} and {e["engine_id"]: e["num_sessions"] for e in m["engines"]}[other] == 0
        status, out = http(f"{proxy.url}/admin/engines/{first}/activate", "POST", token=proxy.admin_token)
        assert {e["engine_id"]: e["status"] for e in out["engines"]}[first] == "active"
        assert http(proxy.url + "/admin/engines/zz/stop_admission", "POST", token=proxy.admin_token)[0] == 404
        # The version an engine serves, as its owner says (SGLang's extra_key): set, refused, unknown.
        url = f"{proxy.url}/admin/engines/{first}/weight_version"
        status, out = http(url, "POST", {"weight_version": 3}, token=proxy.admin_token)
        assert status == 200 and {e["engine_id"]: e["weight_version"] for e in out["engines"]}[first] == 3
        for body in ({"loading": True}, {"loading": False}):  # a load starts, then fails: still 3
            status, out = http(url, "POST", body, token=proxy.admin_token)
            assert status == 200 and {e["engine_id"]: e["weight_version"] for e in out["engines"]}[first] == 3
        for bad in ({"weight_version": -1}, {"weight_version": "3"}, {}, {"loading": True, "weight_version": 4}):
            status, out = http(url, "POST", bad, token=proxy.admin_token)
            assert status == 400 and "weight_version" in json.dumps(out), (bad, out)
        zz = proxy.url + "/admin/engines/zz/weight_version"
        assert http(zz, "POST", {"weight_version": 1}, token=proxy.admin_token)[0] == 404
    finally:
        proxy.stop()


def test_20_drains_during_16_sessions(engines, tmp_path):
    """Drains abort in-flight calls; they resume elsewhere (KV prefix migrated) with no visible error."""
    proxy = start_proxy(tmp_path, [e.url for e in engines], max_imbalance=2)
    turns, num_drains = 4, 20
    try:
        keys = [new_execution(proxy, f"s{i}") for i in range(16)]
        drained = []

        async def drainer(done: asyncio.Event):
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {proxy.admin_token}"}) as s:
                for i in range(num_drains):
                    eid = f"e{i % 3}"
                    async with s.post(f"{proxy.url}/admin/engines/{eid}/drain") as r:
                        assert r.status == 200
                        drained.append((await r.json())["result"]["num_aborted"])
                    await asyncio.sleep(0.15)
                    async with s.post(f"{proxy.url}/admin/engines/{eid}/activate") as r:
                        assert r.status == 200
                    await asyncio.sleep(0.1)
            done.set()

        async def main():
            done = asyncio.Event()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
                sessions = [
                    (anthropic_session if i % 2 else openai_session)(s, proxy.url, k, turns, i % 4 < 2)
                    for i, k in enumerate(keys)
                ]
                results = await asyncio.gather(drainer(done), *sessions, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            assert not errors, errors

        asyncio.run(main())
        status, metrics = http(proxy.url + "/admin/metrics", token=proxy.admin_token)
        rerouted = migrated = 0
        for i in range(16):
            records = assert_clean_chain(tmp_path / "records" / f"s{i}.jsonl", turns)
            rerouted += sum(r.rerouted for r in records)
            migrated += sum(r.num_migrated_tokens for r in records)
        print(
            f"drains aborted {sum(drained)} calls; {rerouted} records rerouted; {migrated} KV tokens migrated; "
            f"{metrics}"
        )
        assert len(drained) == num_drains and sum(drained) > 0 and rerouted > 0
        # the drains' hand-offs moved every session's KV; what was re-prefilled (if any) is the
        # sessions that max_imbalance=2 moved between calls without theirs
        assert metrics["kv_migrated_tokens"] > 0
        assert metrics["kv_reprefill_tokens"] == metrics["kv_reprefill_rerouted_tokens"]
    finally:
        proxy.stop()


def test_crashed_engine_is_detected_and_rerouted(engines, tmp_path):
    victim = start_engine(tmp_path, RULES, name="victim")
    proxy = start_proxy(tmp_path, [victim.url, engines[1].url])
    try:
        keys = [new_execution(proxy, f"c{i}") for i in range(4)]

        def victim_state() -> dict:
            return next(
                e
                for e in http(proxy.url + "/admin/engines", token=proxy.admin_token)[1]["engines"]
                if e["engine_id"] == "e0"
            )

        async def main():
            async with aiohttp.ClientSession() as s:
                tasks = [asyncio.create_task(anthropic_session(s, proxy.url, k, 2, True)) for k in keys]
                while victim_state()["num_inflight"] == 0:  # kill it with calls in flight, not after they finished
                    await asyncio.sleep(0.01)
                victim.proc.kill()  # SIGKILL: connections drop mid-stream
                await asyncio.gather(*tasks)

        asyncio.run(main())
        deadline = time.monotonic() + 30
        while victim_state()["status"] != "dead" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert victim_state()["status"] == "dead"
        records = [r for i in range(4) for r in assert_clean_chain(tmp_path / "records" / f"c{i}.jsonl", 2)]
        assert any(r.rerouted for r in records)
    finally:
        proxy.stop()
        victim.stop()


def test_no_engine_waits_then_overloaded(engines, tmp_path):
    proxy = start_proxy(tmp_path, [], no_engine_wait_s=1.0)
    try:
        key = new_execution(proxy, "w")
        body = {"model": "gyre", "max_tokens": 20, "messages": [{"role": "user", "content": "please"}]}
        t0 = time.monotonic()
        status, out = http(proxy.url + "/v1/messages", "POST", body, headers={"x-api-key": key})
        assert status == 529 and out["error"]["type"] == "overloaded_error" and time.monotonic() - t0 >= 1.0
        status, out = http(
            proxy.url + "/v1/chat/completions",
            "POST",
            {"model": "gyre", "messages": body["messages"]},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert status == 503 and out["error"]["code"] == "overloaded"
        assert (
            http(
                proxy.url + "/admin/engines",
                "POST",
                {"engine_id": "late", "url": engines[2].url, "cell_id": "cell7"},
                token=proxy.admin_token,
            )[0]
            == 200
        )
        assert http(proxy.url + "/v1/messages", "POST", body, headers={"x-api-key": key})[0] == 200
        (record,), _ = read_records(tmp_path / "records" / "w.jsonl")
        assert (record.engine_id, record.cell_id, record.seq) == ("late", "cell7", 0)
    finally:
        proxy.stop()


def _num_inflight(proxy) -> int:
    return sum(e["num_inflight"] for e in http(proxy.url + "/admin/engines", token=proxy.admin_token)[1]["engines"])


def test_sigkill_mid_stream_leaves_records_readable(engines, tmp_path):
    proxy = start_proxy(tmp_path, [engines[2].url])
    keys = [new_execution(proxy, f"k{i}") for i in range(4)]

    async def main():
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(anthropic_session(s, proxy.url, k, 50, True)) for k in keys]
            deadline = time.monotonic() + 120
            while sum(p.stat().st_size for p in (tmp_path / "records").glob("*.jsonl")) == 0:  # some calls done
                assert time.monotonic() < deadline and not any(t.done() for t in tasks)
                await asyncio.sleep(0.05)
            while not await asyncio.to_thread(_num_inflight, proxy):  # others are mid-stream now
                assert time.monotonic() < deadline and not all(t.done() for t in tasks)
                await asyncio.sleep(0.01)
            proxy.kill()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(r, BaseException) for r in results)

    try:
        asyncio.run(main())
    finally:
        proxy.stop()
    total = 0
    for i in range(4):
        records, stats = read_records(tmp_path / "records" / f"k{i}.jsonl")
        assert not stats.invalid
        total += len(records)
        if records:
            build_call_tree(records)
    assert total > 0


def test_restart_continues_numbering_and_token_reuse(engines, tmp_path):
    """A proxy restarted over the same records directory accepts the sandbox's key, numbers on, and
    a continuing conversation reuses the model's exact output ids (the echoed turn re-tokenized
    would differ: the model wrote "; <tool_call>", the template writes ";\\n<tool_call>")."""
    body = {
        "model": "gyre",
        "max_tokens": 400,
        "stream": True,
        "system": "You are a test agent.",
        "tools": A_TOOLS,
        "messages": [{"role": "user", "content": "please take a step"}],
    }

    async def call(url, key):
        async with aiohttp.ClientSession() as s:
            return await anthropic_call(s, url, key, body)

    proxy = start_proxy(tmp_path, [engines[1].url])
    try:
        key = new_execution(proxy, "r")
        msg = asyncio.run(call(proxy.url, key))
    finally:
        proxy.stop()
    use = next(b for b in msg["content"] if b["type"] == "tool_use")
    body["messages"] += [
        {"role": "assistant", "content": msg["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "a.txt"}]},
    ]
    proxy = start_proxy(tmp_path, [engines[1].url])  # a fresh process: no memory but the records
    try:
        asyncio.run(call(proxy.url, key))
    finally:
        proxy.stop()
    first, second = assert_clean_chain(tmp_path / "records" / "r.jsonl", 2)
    assert [first.seq, second.seq] == [0, 1] and second.call_id != first.call_id
    served = np.concatenate((first.input_ids, first.output_ids))
    assert np.array_equal(second.input_ids[: served.size], served)
    assert (second.hints["reused_turns"], second.hints["retokenized_turns"]) == (1, 0)


def test_nested_sub_agent_lineage_reaches_the_tree(engines, tmp_path):
    """Hand-built Claude Code requests: main spawns a1, a1 spawns a2 (parent header); the records name
    each spawner and the tree links each sub-agent's branch to its spawner's latest call."""
    sub_system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_is_subagent=true"},
        {"type": "text", "text": "You are a helper."},
    ]
    calls = [
        ({}, "You are a test agent.", "please take a step"),
        ({"x-claude-code-agent-id": "a1"}, sub_system, "SUB1: please take a step"),
        (
            {"x-claude-code-agent-id": "a2", "x-claude-code-parent-agent-id": "a1"},
            sub_system,
            "SUB2: please take a step",
        ),
    ]
    proxy = start_proxy(tmp_path, [engines[2].url])
    try:
        key = new_execution(proxy, "nest")
        for headers, system, prompt in calls:
            body = {
                "model": "gyre",
                "max_tokens": 400,
                "system": system,
                "tools": A_TOOLS,
                "messages": [{"role": "user", "content": prompt}],
            }
            status, answer = http(proxy.url + "/v1/messages", "POST", body, headers={"x-api-key": key, **headers})
            assert status == 200 and answer["stop_reason"] == "tool_use", answer
    finally:
        proxy.stop()
    records, _ = read_records(tmp_path / "records" / "nest.jsonl")
    assert [(r.agent_id, r.parent_agent_id, r.kind_hint) for r in records] == [
        ("main", None, "main"),
        ("a1", "main", "subagent"),
        ("a2", "a1", "subagent"),
    ]
    tree = build_call_tree(records)
    assert [n.spawned_by for n in tree.nodes] == [None, 0, 1]


def test_benchmark_runs_and_ends_with_json():
    """tools/bench/proxy.py at toy size: its last line is the promised JSON object."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "tools/bench/proxy.py", "--sessions", "2", "--calls", "1", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": "."},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"added_ms_p50", "added_ms_p99", "records_per_s", "in_proxy_ms_p50"} <= set(result) and result[
        "records_per_s"
    ] > 0
