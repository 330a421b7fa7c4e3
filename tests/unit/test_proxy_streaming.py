"""Streaming answers: tool-call input streamed as its tokens arrive, equal to the non-streamed answer."""

import json

import pytest

from gyre.engines.scripted import ScriptedPolicy
from gyre.models.parse import ToolCallScanner
from gyre.models.tokenizer import ByteTokenizer
from gyre.proxy.anthropic import AnthropicWire
from gyre.proxy.chat import ChatRequest
from gyre.proxy.openai import OpenAIWire
from gyre.proxy.wire import OutputStream, Usage

TOK = ByteTokenizer()
S = TOK.special_ids
CHAT = ChatRequest(model="gyre", messages=[], tools=None, max_tokens=100, stream=True, include_usage=True)


def emitted(text: str) -> list[int]:
    """Output ids of a model writing `text` (special-token strings become their ids) and stopping."""
    return ScriptedPolicy([], TOK).encode(text) + [S["<|im_end|>"]]


def run_stream(wire, ids: list[int], step: int = 1) -> tuple[list[tuple], tuple]:
    """(events as (name, data dict), (text, calls)) of streaming `ids` `step` tokens at a time."""
    events = wire.stream(CHAT, Usage(10, 0))
    out = OutputStream(events, TOK.decode, wire.new_call_id)
    sent = list(events.start())
    for n in range(step, len(ids) + step, step):
        sent += out.update(ids[:n])
    text, calls = out.result(ids)
    sent += out.finish(text, calls, "stop", Usage(10, len(ids)))
    return [(name, d) for name, d in sent if d != "[DONE]"], (text, calls)


def anthropic_blocks(events) -> tuple[list[dict], int]:
    """Content blocks reassembled from SSE events, and the number of input_json_delta events."""
    blocks, n_json = {}, 0
    for _, d in events:
        if d["type"] == "content_block_start":
            blocks[d["index"]] = {**d["content_block"], "_json": ""}
        elif d["type"] == "content_block_delta":
            b = blocks[d["index"]]
            if d["delta"]["type"] == "text_delta":
                b["text"] += d["delta"]["text"]
            else:
                b["_json"] += d["delta"]["partial_json"]
                n_json += 1
    out = []
    for i in sorted(blocks):
        b = blocks[i]
        raw = b.pop("_json")
        if b["type"] == "tool_use":
            b["input"] = json.loads(raw)
        out.append(b)
    return out, n_json


ARGS = {"command": "printf '%s\\n' \"a {b} [c]\" && echo caf\u00e9 \u2713", "timeout": 30}
OUTPUT = "Let me look. " + "<tool_call>\n" + json.dumps({"name": "bash", "arguments": ARGS}) + "\n</tool_call>"


@pytest.mark.parametrize("step", [1, 3])
def test_anthropic_streams_tool_input_in_chunks_equal_to_the_plain_answer(step):
    ids = emitted(
        OUTPUT + "<tool_call>\n" + json.dumps({"name": "read", "arguments": {"path": "x"}}) + "\n</tool_call>"
    )
    wire = AnthropicWire(["gyre"], 100)
    events, (text, calls) = run_stream(wire, ids, step)
    blocks, n_json = anthropic_blocks(events)
    parsed = TOK.parse_assistant(ids)
    plain = wire.response(CHAT, parsed.content, [(tid, c) for tid, c in calls], "stop", Usage(10, len(ids)))
    assert [{k: v for k, v in b.items() if k != "id"} for b in blocks] == [
        {k: v for k, v in b.items() if k != "id"} for b in plain["content"]
    ]
    assert [b["id"] for b in blocks if b["type"] == "tool_use"] == [tid for tid, _ in calls]
    assert n_json > 10  # the input arrived in many chunks, not one at the end
    names = [d["type"] for _, d in events]
    assert names.index("content_block_delta") < names.index("message_delta")
    stops = [d for _, d in events if d["type"] == "message_delta"]
    assert stops[0]["delta"]["stop_reason"] == "tool_use" and text == "Let me look."


def test_openai_streams_argument_deltas():
    ids = emitted(OUTPUT)
    events, (_, calls) = run_stream(OpenAIWire(["gyre"], 100), ids)
    merged, n_deltas = {}, 0
    for _, d in events:
        for ch in d["choices"]:
            for tc in ch["delta"].get("tool_calls") or []:
                m = merged.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                m["id"] = tc.get("id") or m["id"]
                m["name"] = tc.get("function", {}).get("name") or m["name"]
                m["arguments"] += tc["function"].get("arguments", "")
                n_deltas += bool(tc["function"].get("arguments"))
    assert n_deltas > 10 and list(merged) == [0]
    assert merged[0]["id"] == calls[0][0] and merged[0]["name"] == "bash" and json.loads(merged[0]["arguments"]) == ARGS
    assert events[-2][1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    "body",
    [
        '{"arguments": {"x": 1}, "name": "f"}',  # arguments first: only the final parse knows the call
        '{"name": "f", "arguments": "{\\"x\\": 1}"}',  # arguments as a JSON string
    ],
)
def test_other_call_forms_are_sent_whole_at_the_end(body):
    ids = emitted(f"<tool_call>\n{body}\n</tool_call>")
    wire = AnthropicWire(["gyre"], 100)
    events, _ = run_stream(wire, ids)
    blocks, n_json = anthropic_blocks(events)
    assert n_json == 1 and blocks == [{"type": "tool_use", "id": blocks[0]["id"], "name": "f", "input": {"x": 1}}]


def test_broken_streamed_call_is_closed_and_not_reported_as_a_call():
    ids = emitted('ok <tool_call>\n{"name": "f", "arguments": {"x": 1}} trailing junk\n</tool_call>')
    wire = AnthropicWire(["gyre"], 100)
    events, (_, calls) = run_stream(wire, ids)
    assert calls == [] and TOK.parse_assistant(ids).tool_calls == []
    names = [d["type"] for _, d in events]
    assert names.count("content_block_start") == names.count("content_block_stop")
    assert next(d for _, d in events if d["type"] == "message_delta")["delta"]["stop_reason"] == "end_turn"


def test_scanner_reads_each_character_once_and_waits_for_the_name():
    sc = ToolCallScanner()
    assert sc.update('x<tool_call>\n{"name": "ba') == []
    assert sc.update('x<tool_call>\n{"name": "bash", "arguments": ') == []
    assert sc.update('x<tool_call>\n{"name": "bash", "arguments": {"a": "}') == [
        ("start", 0, "bash"),
        ("args", 0, '{"a": "}'),
    ]
    assert sc.update('x<tool_call>\n{"name": "bash", "arguments": {"a": "}"}}\n</tool_call>') == [("args", 0, '"}')]
    assert sc.occurrences[0].arguments == '{"a": "}"}' and sc.occurrences[0].body is not None


def test_scanner_finds_markers_split_across_updates():
    text = (
        "pre <tool_call>\n"
        + json.dumps({"name": "a", "arguments": ARGS})
        + "\n</tool_call> mid <tool_call>\n"
        + json.dumps({"name": "b", "arguments": {}})
        + "\n</tool_call><|im_end|><tool_call>"
    )
    sc, events = ToolCallScanner(), []
    for n in range(1, len(text) + 1):
        events += sc.update(text[:n])
    starts = [(k, v) for kind, k, v in events if kind == "start"]
    args = ["".join(v for kind, j, v in events if kind == "args" and j == k) for k, _ in starts]
    assert starts == [(0, "a"), (1, "b")] and [json.loads(a) for a in args] == [ARGS, {}]
