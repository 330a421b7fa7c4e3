"""Pure cores of the proxy: API parsing (tables of bad inputs), token-faithful rendering, streaming
text, hints, routing, and the engine's scripted policy."""

import json

import numpy as np
import pytest

from gyre.engines.scripted import ScriptedPolicy, ScriptRule
from gyre.models.parse import ToolCall, streamable_text
from gyre.models.tokenizer import ByteTokenizer
from gyre.proxy import anthropic, openai, responses
from gyre.proxy.chat import ApiError, ChatRequest
from gyre.proxy.hints import anthropic_hints, openai_hints
from gyre.proxy.render import Renderer, TurnMemory, assistant_key
from gyre.proxy.routing import RoutingError, RoutingTable
from gyre.proxy.wire import Usage

MODELS = ["gyre"]
TOOL = {"name": "f", "description": "d", "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}


def a_body(**kw):
    return {"model": "gyre", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **kw}


def use(tid="t1"):
    return {"role": "assistant", "content": [{"type": "tool_use", "id": tid, "name": "f", "input": {"x": 1}}]}


def result(tid):
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid, "content": "ok"}]}


ANTHROPIC_BAD = [
    ("not-object", [1, 2], "invalid_request", "expected a JSON object"),
    ("unknown-model", a_body(model="gpt-9"), "not_found", "'gpt-9' is not served"),
    ("model-type", a_body(model=3), "invalid_request", "model: expected a string"),
    (
        "max-tokens-missing",
        {"model": "gyre", "messages": [{"role": "user", "content": "x"}]},
        "invalid_request",
        "max_tokens: Field required",
    ),
    ("max-tokens-type", a_body(max_tokens="10"), "invalid_request", "max_tokens: expected an integer"),
    ("max-tokens-bool", a_body(max_tokens=True), "invalid_request", "got a boolean"),
    ("messages-type", a_body(messages="hi"), "invalid_request", "messages: expected a list"),
    ("messages-empty", a_body(messages=[]), "invalid_request", "at least one message"),
    ("role", a_body(messages=[{"role": "robot", "content": "x"}]), "invalid_request", "messages.0.role"),
    (
        "block-type",
        a_body(messages=[{"role": "user", "content": [{"type": "video"}]}]),
        "invalid_request",
        "unsupported block type 'video'",
    ),
    (
        "tool-schema-not-object",
        a_body(tools=[{"name": "f", "input_schema": "str"}]),
        "invalid_request",
        "tools.0.input_schema",
    ),
    (
        "tool-schema-array",
        a_body(tools=[{"name": "f", "input_schema": {"type": "array"}}]),
        "invalid_request",
        "type 'object'",
    ),
    (
        "tool-result-id",
        a_body(messages=[{"role": "user", "content": "x"}, use("t1"), result("t2")]),
        "invalid_request",
        "'t2' does not match",
    ),
    ("tool-result-no-use", a_body(messages=[result("t1")]), "invalid_request", "does not match any tool_use"),
    ("temperature", a_body(temperature=5), "invalid_request", "temperature: must be in"),
    ("stream-type", a_body(stream="yes"), "invalid_request", "stream: expected a boolean"),
]


@pytest.mark.parametrize("case_id,body,kind,text", ANTHROPIC_BAD, ids=[c[0] for c in ANTHROPIC_BAD])
def test_anthropic_bad_input(case_id, body, kind, text):
    with pytest.raises(ApiError) as e:
        anthropic.parse_request(body, MODELS)
    assert e.value.kind == kind and text in e.value.message
    err = anthropic.make_error(e.value)
    assert err["type"] == "error" and err["error"]["message"] == e.value.message


def test_anthropic_conversion():
    body = a_body(
        system=[{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}],
        tools=[TOOL],
        messages=[
            {"role": "user", "content": "q"},
            {"role": "system", "content": "mid"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm"},
                    {"type": "text", "text": "a"},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "r"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "more"},
                ],
            },
        ],
    )
    chat = anthropic.parse_request(body, MODELS)
    assert chat.messages == [
        {"role": "system", "content": "S1\nS2"},
        {"role": "user", "content": "q"},
        {"role": "user", "content": "mid"},
        {"role": "assistant", "content": "a", "tool_calls": [{"id": "t1", "name": "f", "arguments": {"x": 1}}]},
        {"role": "tool", "content": "Error: r", "tool_call_id": "t1"},
        {"role": "user", "content": "more"},
    ]
    assert chat.tools[0]["function"]["parameters"]["type"] == "object"


def test_anthropic_stream_events_shape():
    ev = anthropic.AnthropicStream("m", "gyre", Usage(10, 0, cached=6))
    names = [n for n, _ in ev.start() + ev.text("he") + ev.text("llo")]
    names += [n for n, _ in ev.finish([("tu", ToolCall("f", {"x": 1}))], "stop", Usage(10, 7, cached=6))]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    final = ev.finish([], "length", Usage(10, 3, cached=6))
    assert final[-2][1]["delta"]["stop_reason"] == "max_tokens" and final[-2][1]["usage"]["output_tokens"] == 3


def test_every_api_tells_the_harness_the_engines_cached_tokens():
    """The engine served 6 of the 10 prompt tokens from its cache: each API says so in its own terms,
    answered whole or streamed (Anthropic counts cache reads apart from `input_tokens`)."""
    usage = Usage(10, 3, cached=6)
    chat = ChatRequest(model="gyre", messages=[], tools=None, max_tokens=16, stream=True, include_usage=True)
    a_wire, o_wire, r_wire = (
        w(["gyre"], 16) for w in (anthropic.AnthropicWire, openai.OpenAIWire, responses.ResponsesWire)
    )
    a_stream, o_stream = a_wire.stream(chat, usage._replace(output=0)), o_wire.stream(chat, usage._replace(output=0))
    a_usages = [
        a_wire.response(chat, "ok", [], "stop", usage)["usage"],
        a_stream.start()[0][1]["message"]["usage"],
        a_stream.finish([], "stop", usage)[-2][1]["usage"],
    ]
    assert [(u["input_tokens"], u["cache_read_input_tokens"]) for u in a_usages] == [(4, 6)] * 3
    o_usages = [
        o_wire.response(chat, "ok", [], "stop", usage)["usage"],
        o_stream.finish([], "stop", usage)[-2][1]["usage"],
    ]
    assert [(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]) for u in o_usages] == [(10, 6)] * 2
    r = r_wire.response(chat, "ok", [], "stop", usage)["usage"]
    assert (r["input_tokens"], r["input_tokens_details"]["cached_tokens"]) == (10, 6)


OPENAI_BAD = [
    ("unknown-model", {"model": "x", "messages": [{"role": "user", "content": "h"}]}, "not_found", "does not exist"),
    ("messages-type", {"model": "gyre", "messages": {}}, "invalid_request", "messages: expected an array"),
    (
        "tool-params",
        {
            "model": "gyre",
            "messages": [{"role": "user", "content": "h"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
        },
        "invalid_request",
        "tools[0].function.parameters",
    ),
    (
        "tool-call-id",
        {
            "model": "gyre",
            "messages": [{"role": "user", "content": "h"}, {"role": "tool", "tool_call_id": "zz", "content": "r"}],
        },
        "invalid_request",
        "'zz' does not answer",
    ),
    (
        "bad-arguments",
        {
            "model": "gyre",
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                }
            ],
        },
        "invalid_request",
        "not valid JSON",
    ),
    ("n", {"model": "gyre", "n": 2, "messages": [{"role": "user", "content": "h"}]}, "invalid_request", "only n=1"),
]


@pytest.mark.parametrize("case_id,body,kind,text", OPENAI_BAD, ids=[c[0] for c in OPENAI_BAD])
def test_openai_bad_input(case_id, body, kind, text):
    with pytest.raises(ApiError) as e:
        openai.parse_request(body, MODELS, 100)
    assert e.value.kind == kind and text in e.value.message
    assert openai.make_error(e.value)["error"]["message"] == e.value.message


def test_openai_round_trip_and_stream():
    body = {
        "model": "gyre",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "q"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 2}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "r"},
        ],
    }
    chat = openai.parse_request(body, MODELS, 100)
    assert chat.max_tokens == 100 and chat.include_usage
    assert chat.messages[2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "name": "f", "arguments": {"x": 2}}],
    }
    chunks = openai.OpenAIStream("id", "gyre", True)
    events = chunks.start() + chunks.text("a") + chunks.finish([("c9", ToolCall("f", {"x": 1}))], "stop", Usage(5, 2))
    *out, done = [d for _, d in events]
    assert done == "[DONE]"
    assert out[-2]["choices"][0]["finish_reason"] == "tool_calls" and out[-1]["usage"]["total_tokens"] == 7
    assert json.loads(out[-3]["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]) == {"x": 1}


def test_render_reuses_model_tokens_exactly():
    """A remembered assistant turn is rendered from the model's own ids, not re-tokenized text."""
    tok = ByteTokenizer()
    r, mem = Renderer(tok), TurnMemory()
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    first = r.render(msgs, None, mem).input_ids.tolist()
    # The model emitted a tool call with odd spacing; the harness echoes it back parsed.
    out = list(b"ok ") + [tok.special_ids["<tool_call>"]] + list(b'\n{"name":"f","arguments":{"x":1}}\n')
    out += [tok.special_ids["</tool_call>"], tok.eos_token_id]
    parsed = tok.parse_assistant(out)
    mem.remember(
        assistant_key(parsed.content, [{"name": c.name, "arguments": c.arguments} for c in parsed.tool_calls]), out
    )
    echoed = {"role": "assistant", "content": "ok", "tool_calls": [{"id": "t", "name": "f", "arguments": {"x": 1}}]}
    second = r.render(msgs + [echoed, {"role": "tool", "content": "r"}], None, mem)
    assert second.input_ids.tolist()[: len(first) + len(out)] == first + out
    assert (second.num_reused, second.num_retokenized) == (1, 0)
    edited = r.render(msgs + [{**echoed, "content": "edited"}, {"role": "tool", "content": "r"}], None, mem)
    assert (edited.num_reused, edited.num_retokenized) == (0, 1)
    assert edited.input_ids.tolist() == tok.apply_chat_template(
        msgs + [{**echoed, "content": "edited"}, {"role": "tool", "content": "r"}]
    )


def test_render_length_finish_gets_end_of_turn():
    tok = ByteTokenizer()
    r, mem = Renderer(tok), TurnMemory()
    mem.remember(assistant_key("abc", []), list(b"abc"))
    ids = r.render(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "abc"}, {"role": "user", "content": "n"}],
        None,
        mem,
    ).input_ids.tolist()
    assert ids == tok.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "abc"}, {"role": "user", "content": "n"}]
    )


@pytest.mark.parametrize(
    "text,shown",
    [
        ("  hello ", "hello"),
        ("hi <tool_call>\n{", "hi"),
        ("hi <tool_", "hi"),
        ("done<|im_end|>", "done"),
        ("caf\ufffd", "caf"),
        ("a < b", "a < b"),
    ],
)
def test_streamable_text(text, shown):
    assert streamable_text(text) == shown


def test_claude_code_hints():
    h = anthropic_hints(
        {"x-claude-code-agent-id": "a1", "x-api-key": "secret"},
        {"system": [{"type": "text", "text": "cc_is_subagent=true"}]},
        False,
        True,
    )
    assert (h.agent_id, h.parent_agent_id, h.kind_hint) == ("a1", "main", "subagent") and "x-api-key" not in h.raw
    assert anthropic_hints({}, {}, True, True).kind_hint == "summary"
    assert anthropic_hints({}, {}, False, False).kind_hint == "auxiliary"
    assert anthropic_hints({"x-claude-code-agent-id": "a1"}, {}, True, True).kind_hint == "subagent_summary"
    assert openai_hints({"x-gyre-agent-id": "s2"}, {}).parent_agent_id == "main"
    assert openai_hints({"x-gyre-call-kind": "summary"}, {"tools": []}).kind_hint == "summary"
    assert openai_hints({}, {"tools": [{}]}).kind_hint == "main"


def test_summary_request_shape():
    ask = "Create a detailed summary of the conversation. REMINDER: Do NOT call any tools."
    assert anthropic.summary_request({"messages": [{"role": "user", "content": [{"type": "text", "text": ask}]}]})
    note = "<task-notification><summary>Agent finished</summary><note>not a tool</note></task-notification>"
    assert not anthropic.summary_request({"messages": [{"role": "user", "content": note}]})


def test_routing_sticky_balanced_and_drained():
    t = RoutingTable(max_imbalance=1)
    t.add("a", "u1")
    t.add("b", "u2")
    assert t.pick("s1") == "a" and t.pick("s2") == "a"  # least loaded, ties by id
    t.begin("r1", "a", "s1")
    assert t.pick("s2") == "a"  # sticky within the imbalance
    t.begin("r2", "a", "s1")
    assert t.pick("s2") == "b"  # a is 2 ahead of b: move
    t.stop_streaming("r2")
    assert (
        t.engines["a"].num_inflight == 1 and t.streaming("a") == ["r1"] and set(t.engines["a"].flights) == {"r1", "r2"}
    )
    t.end("r2")
    assert set(t.flights) == {"r1"}
    t.set_status("b", "draining")
    assert t.pick("s2") == "a" and t.pick("s3", exclude=frozenset(["a"])) is None
    with pytest.raises(RoutingError, match="registered: a, b|registered: \\['a', 'b'\\]"):
        t.get("zz")
    with pytest.raises(RoutingError, match="valid: active"):
        t.set_status("a", "sleeping")


@pytest.mark.parametrize(
    "case_id, ops, expect",
    [
        ("new-session-avoids-closing", [("s1", "a"), ("close", "a"), ("s2", "b")], {"a": 1, "b": 1}),
        ("old-session-stays-on-closing", [("s1", "a"), ("close", "a"), ("s1", "a")], {"a": 1, "b": 0}),
        (
            "closing-alone-keeps-its-own",
            [("s1", "a"), ("close", "a"), ("close", "b"), ("s1", "a"), ("s2", None)],
            {"a": 1, "b": 0},
        ),
        ("activate-reverts", [("close", "a"), ("activate", "a"), ("s1", "a")], {"a": 1, "b": 0}),
        ("drain-moves-closing-sessions", [("s1", "a"), ("close", "a"), ("drain", "a"), ("s1", "b")], {"a": 0, "b": 1}),
    ],
)
def test_routing_stop_admission(case_id, ops, expect):
    t = RoutingTable(max_imbalance=4)
    t.add("a", "u1")
    t.add("b", "u2")
    for op, arg in ops:
        if op in ("close", "activate", "drain"):
            t.set_status(arg, {"close": "closing", "activate": "active", "drain": "draining"}[op])
        else:
            assert t.pick(op) == arg, (case_id, op)
    assert t.num_sessions() == expect
    assert t.executions_with_sessions() == ({"s1"} if "s1" in t.sessions else set()) | (
        {"s2"} if "s2" in t.sessions else set()
    )


def _table(sessions: dict[str, str], statuses: dict[str, str]) -> RoutingTable:
    t = RoutingTable()
    for eid, status in statuses.items():
        t.add(eid, "u")
        t.set_status(eid, status)
    t.sessions.update(sessions)
    return t


@pytest.mark.parametrize(
    "case_id, sessions, statuses, expect",
    [
        (
            "spread-over-two",
            {"s1": "a", "s2": "a", "s3": "a"},
            {"a": "draining", "b": "active", "c": "active"},
            {"s1": "b", "s2": "c", "s3": "b"},
        ),
        (
            "fill-the-emptier",
            {"s1": "a", "s2": "a", "x": "b", "y": "b"},
            {"a": "draining", "b": "active", "c": "active"},
            {"s1": "c", "s2": "c"},
        ),
        ("not-onto-closing", {"s1": "a"}, {"a": "draining", "b": "closing", "c": "active"}, {"s1": "c"}),
        ("none-active-they-stay", {"s1": "a"}, {"a": "draining", "b": "closing"}, {}),
    ],
)
def test_reassign_gives_every_session_of_a_leaving_engine_the_least_loaded_active_one(
    case_id, sessions, statuses, expect
):
    t = _table(sessions, statuses)
    assert t.reassign("a") == expect
    assert {s: e for s, e in t.sessions.items() if s in sessions and sessions[s] == "a"} == (expect or {"s1": "a"})


@pytest.mark.parametrize(
    "case_id, sessions, busy, expect_counts",
    [
        ("even-out", {f"s{i}": "a" for i in range(6)}, [], {"a": 3, "b": 0, "r": 3}),
        (
            "two-sources",
            {**{f"a{i}": "a" for i in range(5)}, **{f"b{i}": "b" for i in range(3)}},
            [],
            {"a": 3, "b": 3, "r": 2},
        ),
        ("within-one-stays", {"s1": "a", "s2": "b"}, [], {"a": 1, "b": 1, "r": 0}),
        ("busy-sessions-stay", {f"s{i}": "a" for i in range(4)}, ["s0", "s1", "s2"], {"a": 3, "b": 0, "r": 1}),
    ],
)
def test_rebalance_on_return_takes_idle_sessions_from_the_most_loaded(case_id, sessions, busy, expect_counts):
    t = _table(sessions, {"a": "active", "b": "active", "r": "active"})
    for i, s in enumerate(busy):
        t.begin(f"rid{i}", sessions[s], s)
    moves = t.rebalance("r")
    assert t.num_sessions() == expect_counts
    assert all(t.sessions[s] == "r" and sessions[s] == src for s, src in moves.items()) and not set(moves) & set(busy)


def test_engine_client_keys_sglang_generations_by_weight_version():
    from gyre.engines.client import EngineClient, _version

    c = EngineClient("http://x", key_by_weight_version=True)
    assert "extra_key" not in c._generate_body([1], {}, "r", True, False, None)
    c.weight_version = _version("7", None)
    assert c.weight_version == 7 and c._generate_body([1], {}, "r", True, False, None)["extra_key"] == "7"
    builtin = EngineClient("http://x")
    builtin.weight_version = 7
    assert "extra_key" not in builtin._generate_body([1], {}, "r", True, False, None)


def test_sglang_calls_carry_the_version_the_engine_serves_not_the_last_answers():
    """The key comes from the owner (serve_version), never from an answer, which lags an update by
    one call; while a load runs (hold_calls) a keyed call waits and then carries the new version."""
    import asyncio

    from gyre.engines.client import EngineClient

    async def go() -> list:
        c = EngineClient("http://x", key_by_weight_version=True)
        sent = []

        async def request(method, path, body=None, raw=None):
            sent.append(json.loads(raw)["extra_key"])
            return {"meta_info": {"weight_version": "0"}}  # an answer of the old version

        c._request = request
        c.serve_version(0)
        await c.generate([1])
        c.hold_calls()
        held = asyncio.create_task(c.generate([2]))
        for _ in range(10):  # every ready task runs to its next wait; no time passes
            await asyncio.sleep(0)
        waiting = not held.done() and len(sent) == 1
        c.serve_version(1)
        await held
        await c.generate([3])
        return [sent, waiting, c.weight_version]

    assert asyncio.run(go()) == [["0", "1", "1"], True, 1]


def test_engine_client_stream_stopped_at_its_finish_chunk_keeps_the_connection():
    """The proxy stops reading a /generate stream at the chunk with a finish_reason; the client
    has read the rest of the body by then, so the next call reuses the connection (an unread
    body would make aiohttp close it: one more TCP connect per call)."""
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from gyre.engines.client import EngineClient

    peers = []

    async def generate(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for done in (None, {"type": "stop"}):
            chunk = {
                "output_ids": [1],
                "meta_info": {"finish_reason": done, "output_token_logprobs": [[-0.1, 1, None]]},
            }
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.05)  # the end of the chunked body comes later (as from a busy server)
        return resp

    async def run() -> None:
        app = web.Application()
        app.add_routes([web.post("/generate", generate)])
        async with TestServer(app) as server, EngineClient(str(server.make_url(""))) as client:
            for _ in range(3):
                async for chunk in client.generate_stream([1, 2], {"max_new_tokens": 2}):
                    if chunk["meta_info"]["finish_reason"]:
                        break  # as gyre.proxy.pool.Generation does

    asyncio.run(run())
    assert len(peers) == 3 and len(set(peers)) == 1, peers


def test_scripted_policy_resumes_mid_output():
    tok = ByteTokenizer()
    policy = ScriptedPolicy([ScriptRule(__import__("re").compile("ping"), "pong <tool_call>x</tool_call>")], tok)
    prompt = tok.apply_chat_template([{"role": "user", "content": "ping"}])
    full = policy.forced_ids(prompt)
    assert tok.decode(full) == "pong <tool_call>x</tool_call><|im_end|>"
    assert policy.forced_ids(prompt + full[:5]) == full[5:]
    assert policy.forced_ids(tok.apply_chat_template([{"role": "user", "content": "other"}])) is None


class _SystemInjectingTokenizer(ByteTokenizer):
    """A template that adds a default system prompt when none is given (as Qwen's HF template does)."""

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True):
        if not messages or messages[0]["role"] != "system":
            messages = [{"role": "system", "content": "default"}, *messages]
        return super().apply_chat_template(messages, tools, add_generation_prompt)


class _TurnNumberingTokenizer(ByteTokenizer):
    """A template that numbers user turns by position: a message renders differently on its own."""

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True):
        messages = [
            {**m, "content": f"[{i}] {m['content']}"} if m["role"] == "user" else m for i, m in enumerate(messages)
        ]
        return super().apply_chat_template(messages, tools, add_generation_prompt)


class _ToolJoiningTokenizer(ByteTokenizer):
    """A template that writes consecutive tool results as one turn (as Qwen's does)."""

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True):
        joined = []
        for m in messages:
            if m["role"] == "tool" and joined and joined[-1]["role"] == "tool":
                joined[-1] = {**joined[-1], "content": joined[-1]["content"] + " | " + m["content"]}
            else:
                joined.append(m)
        return super().apply_chat_template(joined, tools, add_generation_prompt)


def test_render_keeps_consecutive_tool_results_in_one_turn():
    tok = _ToolJoiningTokenizer()
    r, mem = Renderer(tok), TurnMemory()
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}],
    }
    msgs = [
        {"role": "user", "content": "q"},
        call,
        {"role": "tool", "content": "r1"},
        {"role": "tool", "content": "r2"},
    ]
    mem.remember(
        assistant_key("", call["tool_calls"]), tok.apply_chat_template([call], None, False)[len(r.gen_prompt) : -1]
    )
    out = r.render(msgs, None, mem)
    assert r.separable and out.input_ids.tolist() == tok.apply_chat_template(msgs) and out.num_reused == 1


def test_render_reuses_tokens_under_a_template_injecting_a_default_system_prompt():
    tok = _SystemInjectingTokenizer()
    r, mem = Renderer(tok), TurnMemory()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "n"}]
    mem.remember(assistant_key("a", []), list(b"a") + [tok.eos_token_id])
    for t in (None, tools):
        out = r.render(msgs, t, mem)
        assert (
            r.separable
            and out.input_ids.tolist() == tok.apply_chat_template(msgs, t)
            and (out.num_reused, out.num_retokenized) == (1, 0)
        )


def test_render_falls_back_to_whole_rendering_for_non_separable_templates():
    tok = _TurnNumberingTokenizer()
    r, mem = Renderer(tok), TurnMemory()
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "n"}]
    mem.remember(assistant_key("a", []), list(b"a") + [tok.eos_token_id])
    out = r.render(msgs, None, mem)
    assert not r.separable and out.input_ids.tolist() == tok.apply_chat_template(msgs) and out.num_retokenized == 1


def test_incremental_text_matches_full_decode():
    from gyre.proxy.wire import IncrementalText

    tok = ByteTokenizer()
    ids = list("héllo wörld ✓ done".encode()) + [tok.special_ids["<tool_call>"]] + list(b"x")
    inc = IncrementalText(tok.decode)
    for n in range(1, len(ids) + 1):
        seen = inc.update(ids[:n])
        full = tok.decode(ids[:n])
        assert seen == full or (full.endswith("\ufffd") and seen.rstrip("\ufffd") == full.rstrip("\ufffd"))
    assert inc.update(ids) == tok.decode(ids)


def test_turn_memory_prefers_the_asking_agents_own_tokens():
    mem = TurnMemory()
    key = assistant_key("same text", [])
    mem.remember(key, [1, 2], agent_id="main")
    mem.remember(key, [3, 4], agent_id="sub")
    assert mem.get(key, "main") == [1, 2] and mem.get(key, "sub") == [3, 4]
    assert mem.get(key, "fork") == [3, 4]  # another agent echoing the turn: the latest ids
    assert mem.get(assistant_key("other", []), "main") is None


def test_generation_takes_versions_of_new_tokens_from_spans():
    from gyre.proxy.generation import Generation

    g = Generation(
        pool=None,
        session="s",
        rid="r",
        input_ids=np.array([1], np.int32),
        input_json=(b"[1]",),
        sampling={"max_new_tokens": 9},
    )
    spans = [{"weight_version": "3", "start": 0, "end": 2}, {"weight_version": "4", "start": 2, "end": 5}]
    g._extend([7], [-0.5], {"weight_version_spans": spans[:1]}, 0)
    g._extend([8, 9, 10], [-0.1, -0.2, -0.3], {"weight_version_spans": spans}, 1)
    assert g.output_ids == [7, 8, 9, 10] and g.versions == [3, 3, 4, 4]
    with pytest.raises(ApiError, match="bad weight versions: weight_version must be an integer >= 0"):
        g._extend([11], [-0.1], {"weight_version": "default"}, 4)  # Gyre launches SGLang with a numbered version
    with pytest.raises(ApiError, match="cover 1 of 2 new tokens"):
        g._extend([11, 12], [-0.1, -0.1], {"weight_version_spans": spans[:1]}, 1)
    with pytest.raises(ApiError, match="2 log-probs for 1 tokens"):
        g._extend([1], [-1.0, -1.0], {}, 4)
