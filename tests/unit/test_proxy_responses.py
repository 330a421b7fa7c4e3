"""The Responses API front end (pure): bad input answers 4xx naming the field, output items fold
back into one assistant turn each, and resuming a conversion equals converting from scratch."""

import pytest

from gyre.models.parse import ToolCall
from gyre.proxy import responses
from gyre.proxy.chat import ApiError, Resume
from gyre.proxy.wire import Usage

TOOLS = [{"type": "function", "name": "bash", "parameters": {"type": "object"}}]
GOOD = {"model": "gyre", "input": "hi"}


@pytest.mark.parametrize(
    "case_id, body, kind, text",
    [
        ("unknown-model", {**GOOD, "model": "x"}, "not_found", "does not exist"),
        ("input-not-list", {**GOOD, "input": 5}, "invalid_request", "input: expected a string or a list"),
        ("empty-input", {**GOOD, "input": []}, "invalid_request", "at least one item"),
        ("bad-item-type", {**GOOD, "input": [{"type": "web_search_call"}]}, "invalid_request", "input[0].type"),
        ("bad-role", {**GOOD, "input": [{"role": "robot", "content": "x"}]}, "invalid_request", "input[0].role"),
        (
            "bad-part",
            {**GOOD, "input": [{"role": "user", "content": [{"type": "audio"}]}]},
            "invalid_request",
            "input[0].content[0].type",
        ),
        (
            "bad-arguments",
            {**GOOD, "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
            "invalid_request",
            "input[0].arguments",
        ),
        (
            "unanswered-output",
            {**GOOD, "input": [{"type": "function_call_output", "call_id": "c9", "output": "r"}]},
            "invalid_request",
            "'c9' does not answer",
        ),
        (
            "custom-tool",
            {**GOOD, "tools": [{"type": "custom", "name": "apply_patch"}]},
            "invalid_request",
            "tools[0].type",
        ),
        (
            "bad-schema",
            {**GOOD, "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
            "invalid_request",
            "type 'object'",
        ),
        ("bad-max", {**GOOD, "max_output_tokens": 0}, "invalid_request", "max_output_tokens: must be >= 1"),
        ("stateful", {**GOOD, "previous_response_id": "resp_1"}, "invalid_request", "previous_response_id"),
    ],
)
def test_bad_input(case_id, body, kind, text):
    with pytest.raises(ApiError) as e:
        responses.parse_request(body, ["gyre"], 64)
    assert e.value.kind == kind and text in e.value.message, (case_id, e.value.message)


CONVERSATION = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
    {"role": "user", "content": "fix it"},
    {"type": "reasoning", "summary": []},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
    {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": '{"cmd": "ls"}'},
    {"type": "function_call", "call_id": "c2", "name": "bash", "arguments": '{"cmd": "pwd"}'},
    {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
    {"type": "function_call_output", "call_id": "c2", "output": "/repo"},
    {"type": "function_call", "call_id": "c3", "name": "bash", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c3", "output": [{"type": "input_text", "text": "ok"}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
]


def test_output_items_fold_into_assistant_turns():
    chat = responses.parse_request({**GOOD, "instructions": "sys", "input": CONVERSATION, "tools": TOOLS}, ["gyre"], 64)
    assert [m["role"] for m in chat.messages] == [
        "system",
        "user",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert chat.messages[3] == {
        "role": "assistant",
        "content": "Looking.",
        "tool_calls": [
            {"id": "c1", "name": "bash", "arguments": {"cmd": "ls"}},
            {"id": "c2", "name": "bash", "arguments": {"cmd": "pwd"}},
        ],
    }
    assert chat.messages[6] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c3", "name": "bash", "arguments": {}}],
    }
    assert (
        chat.messages[-1] == {"role": "assistant", "content": "Done."} and chat.tools[0]["function"]["name"] == "bash"
    )
    codex_tools = [
        *TOOLS,
        {"type": "web_search", "external_web_access": True},
        {
            "type": "namespace",
            "name": "multi_agent_v1",
            "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}],
        },
    ]
    chat = responses.parse_request({**GOOD, "tools": codex_tools}, ["gyre"], 64)
    assert [t["function"]["name"] for t in chat.tools] == [
        "bash",
        "spawn_agent",
    ]  # hosted tools left out, namespaces flattened


@pytest.mark.parametrize("num_shared", range(1, len(CONVERSATION) + 1))
def test_resumed_conversion_equals_a_fresh_one(num_shared):
    """Resuming anywhere, inside a turn's run of function_call items too, converts like from scratch."""
    body = {**GOOD, "input": CONVERSATION[:num_shared]}
    before = responses.parse_request(body, ["gyre"], 64)
    longer = {**GOOD, "input": CONVERSATION[:num_shared] + [{"role": "user", "content": "more"}]}
    resumed = responses.parse_request(longer, ["gyre"], 64, Resume(before.messages, before.marks, num_shared))
    assert resumed.messages == responses.parse_request(longer, ["gyre"], 64).messages


def test_stream_events_are_numbered_and_close_each_item():
    chat = responses.parse_request({**GOOD, "tools": TOOLS}, ["gyre"], 64)
    ev = responses.ResponsesStream("resp_1", chat)
    out = (
        ev.start()
        + ev.text("Look")
        + ev.text("ing.")
        + ev.tool_start("call_1", "bash")
        + ev.tool_args('{"cmd":')
        + ev.tool_args(' "ls"}')
    )
    out += ev.finish(
        [("call_1", ToolCall("bash", {"cmd": "ls"})), ("call_2", ToolCall("bash", {}))],
        "stop",
        Usage(5, 7),
    )
    assert [d["sequence_number"] for _, d in out] == list(range(len(out)))
    assert (
        [n for n, _ in out].count("response.output_item.added")
        == [n for n, _ in out].count("response.output_item.done")
        == 3
    )
    done = out[-1][1]["response"]
    assert out[-1][0] == "response.completed" and done["usage"]["total_tokens"] == 12
    assert [(o["type"], o.get("arguments")) for o in done["output"]] == [
        ("message", None),
        ("function_call", '{"cmd": "ls"}'),
        ("function_call", "{}"),
    ]
    assert done["output"][0]["content"][0]["text"] == "Looking."
    incomplete = responses.ResponsesStream("resp_2", chat)
    assert incomplete.finish([], "length", Usage(1, 1))[-1][1]["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
