"""Per-call work that tracks what a call adds: a conversation's next call converts and renders only
its new messages, yet its prompt equals a full rendering; retries are recognised without hashing;
the messages a call shares with its snapshot are found by comparing body bytes where they allow."""

import copy
import json

import orjson
import pytest

from gyre.models.tokenizer import ByteTokenizer
from gyre.proxy import conversation
from gyre.proxy.anthropic import AnthropicWire
from gyre.proxy.calls import CallRunner
from gyre.proxy.config import ProxyConfig
from gyre.proxy.conversation import num_shared, num_shared_messages
from gyre.proxy.executions import ExecutionRegistry
from gyre.proxy.openai import OpenAIWire
from gyre.proxy.render import Renderer, assistant_key
from gyre.proxy.wire import split_request


class CountingTokenizer(ByteTokenizer):
    """Counts the message characters the chat template is asked to render."""

    num_chars = 0

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True):
        self.num_chars += sum(len(m.get("content") or "") for m in messages)
        return super().apply_chat_template(messages, tools, add_generation_prompt)


class InjectingTokenizer(CountingTokenizer):
    """A template that injects a default system prompt where none leads (as Qwen's does): the
    renderer renders runs after an anchor system message it cuts off again."""

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True):
        if not messages or messages[0]["role"] != "system":
            messages = [{"role": "system", "content": "default"}, *messages]
        return super().apply_chat_template(messages, tools, add_generation_prompt)


TOOLS = [{"name": "bash", "description": "run", "input_schema": {"type": "object"}}]


def answer(tok, n: int) -> tuple[list[int], dict]:
    """The model's ids for a tool call, and the assistant message a harness echoes back."""
    s = tok.special_ids
    out = (
        list(b"ok")
        + [s["<tool_call>"]]
        + list(f'{{"name": "bash", "arguments": {{"n": {n}}}}}'.encode())
        + [s["</tool_call>"], s["<|im_end|>"]]
    )
    return out, {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "ok"},
            {"type": "tool_use", "id": f"t{n}", "name": "bash", "input": {"n": n}},
        ],
    }


def result(n: int, text: str) -> dict:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{n}", "content": text}]}


@pytest.fixture(params=[CountingTokenizer, InjectingTokenizer], ids=["plain", "default-system"])
def setup(tmp_path, request):
    tok = request.param()
    runner = CallRunner(ProxyConfig(records_dir=str(tmp_path)), tok, Renderer(tok), pool=None)
    ex = ExecutionRegistry(str(tmp_path), fsync=False).create("e1")
    return tok, runner, ex


def serve(tok, runner, ex, body: dict, n: int):
    """Render one call as the proxy does and remember the model's answer; (rendered, retry, answer
    message, message characters the template rendered for the call)."""
    before = tok.num_chars
    chat, hints, rendered, retry = runner.render(ex, AnthropicWire(["gyre"], 16), body, {}, raw=orjson.dumps(body))
    used = tok.num_chars - before
    full = runner.renderer.render(chat.messages, chat.tools, ex.turns, hints.agent_id)  # no snapshot: from scratch
    assert rendered.input_ids.tolist() == full.input_ids.tolist() and b"".join(rendered.input_json) == b"".join(
        full.input_json
    )
    out, echoed = answer(tok, n)
    parsed = tok.parse_assistant(out)
    ex.turns.remember(
        assistant_key(parsed.content, [{"name": c.name, "arguments": c.arguments} for c in parsed.tool_calls]), out
    )
    return rendered, retry, echoed, used


@pytest.mark.parametrize("system", ["sys " * 50, None], ids=["system", "no-system"])
def test_growing_conversation_renders_only_new_messages(setup, system):
    tok, runner, ex = setup
    body = {"model": "gyre", "max_tokens": 16, "tools": TOOLS, "messages": [{"role": "user", "content": "go"}]}
    if system:
        body["system"] = system
    anchor = len("anchor") if runner.renderer.anchored else 0  # the cut-off system message runs render after
    rendered, retry, echoed, _ = serve(tok, runner, ex, body, 0)
    assert rendered.num_rendered_messages == (2 if system else 1) and not retry  # system and user
    for n in range(1, 6):
        body = copy.deepcopy(body)  # a harness sends fresh JSON each time: equal, not identical, objects
        body["messages"] += [echoed, result(n - 1, f"output {n} " * 40)]
        rendered, retry, echoed, used = serve(tok, runner, ex, body, n)
        # this call: the echoed turn (from memory) and one tool result, the only text the template saw
        assert rendered.num_rendered_messages == 2 and rendered.num_reused == n and not retry
        assert used == len(f"output {n} " * 40) + anchor, "the earlier history was rendered again"


@pytest.mark.parametrize(
    "case_id, edit, retry",
    [
        ("same-body", lambda b: b, True),
        ("stream-flag-only", lambda b: {**b, "stream": True}, True),
        ("other-max-tokens", lambda b: {**b, "max_tokens": 8}, False),
        (
            "user-text-joins-the-last-run",
            lambda b: {**b, "messages": b["messages"] + [{"role": "user", "content": "more"}]},
            False,
        ),
        (
            "edited-early-result",
            lambda b: {**b, "messages": b["messages"][:2] + [result(0, "changed")] + b["messages"][3:]},
            False,
        ),
        ("other-system", lambda b: {**b, "system": "other"}, False),
    ],
)
def test_variants_render_like_a_full_rendering(setup, case_id, edit, retry):
    tok, runner, ex = setup
    body = {
        "model": "gyre",
        "max_tokens": 16,
        "system": "sys",
        "tools": TOOLS,
        "messages": [{"role": "user", "content": "go"}],
    }
    _, _, echoed, _ = serve(tok, runner, ex, body, 0)
    body = {**body, "messages": body["messages"] + [echoed, result(0, "r0")]}
    _, _, echoed, _ = serve(tok, runner, ex, body, 1)
    body = {**body, "messages": body["messages"] + [echoed, result(1, "r1")]}
    serve(tok, runner, ex, body, 2)
    _, is_retry, _, _ = serve(tok, runner, ex, copy.deepcopy(edit(body)), 3)  # serve() checks it equals a full render
    assert is_retry == retry, case_id


def test_openai_conversation_resumes_too(setup):
    tok, runner, ex = setup
    wire = OpenAIWire(["gyre"], 16)
    body = {"model": "gyre", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "go"}]}
    for n in range(3):
        chat, hints, rendered, _ = runner.render(ex, wire, copy.deepcopy(body), {})
        assert rendered.input_ids.tolist() == runner.renderer.render(chat.messages, None, ex.turns).input_ids.tolist()
        assert rendered.num_rendered_messages == 2  # system and user, then the echoed turn and the result
        out, _ = answer(tok, n)
        ex.turns.remember(assistant_key("ok", [{"name": "bash", "arguments": {"n": n}}]), out)
        call = {"id": f"c{n}", "type": "function", "function": {"name": "bash", "arguments": f'{{"n": {n}}}'}}
        body["messages"] += [
            {"role": "assistant", "content": "ok", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{n}", "content": "x"},
        ]


def test_retry_is_recognised_after_a_restart(tmp_path):
    """A restarted proxy has no snapshots: the first call repeating the agent's last recorded prompt
    is a retry; the one after it, extending the conversation, is not."""
    import asyncio

    from gyre.records.record import CallRecord

    tok = CountingTokenizer()
    runner = CallRunner(ProxyConfig(records_dir=str(tmp_path)), tok, Renderer(tok), pool=None)
    reg = ExecutionRegistry(str(tmp_path), fsync=False, parse=tok.parse_assistant)
    ex = reg.create("e1")
    body = {
        "model": "gyre",
        "max_tokens": 16,
        "system": "sys",
        "tools": TOOLS,
        "messages": [{"role": "user", "content": "go"}],
    }
    _, _, rendered, _ = runner.render(ex, AnthropicWire(["gyre"], 16), body, {})
    out, echoed = answer(tok, 0)
    asyncio.run(
        ex.append(
            CallRecord.build(
                input_ids=rendered.input_ids,
                output_ids=out,
                logprobs=[-0.1] * len(out),
                versions=[0] * len(out),
                execution_id="e1",
                call_id="c0",
                seq=0,
                agent_id="main",
                parent_agent_id=None,
                kind_hint="main",
                finish_reason="stop",
            )
        )
    )
    reg.close()
    ex2 = ExecutionRegistry(str(tmp_path), fsync=False, parse=tok.parse_assistant).by_id["e1"]  # the restarted proxy
    asyncio.run(ex2.ready())
    _, _, again, retry = runner.render(ex2, AnthropicWire(["gyre"], 16), copy.deepcopy({**body, "stream": True}), {})
    assert retry and again.input_ids.tolist() == rendered.input_ids.tolist()
    body["messages"] += [echoed, result(0, "r0")]
    _, _, longer, retry = runner.render(ex2, AnthropicWire(["gyre"], 16), body, {})
    assert (
        not retry
        and longer.input_ids[: rendered.input_ids.size + len(out)].tolist() == rendered.input_ids.tolist() + out
    )


M = [
    {"role": "user", "content": "go"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t0", "name": "bash", "input": {}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t0", "content": "r0 \u00e9\n"}]},
]
NEW = {"role": "assistant", "content": "ok"}


SPACED = lambda b: json.dumps(b).encode()  # noqa: E731  (Python's default separators: ", " and ": ")


@pytest.mark.parametrize(
    "case_id, old, new, dumps, found, by_bytes",
    [
        (
            "messages-last",
            {"system": "s", "messages": M},
            {"system": "s", "messages": [*M, NEW]},
            orjson.dumps,
            True,
            True,
        ),
        (
            "messages-first",
            {"messages": M, "system": "s", "stream": True},
            {"messages": [*M, NEW], "system": "s", "stream": True},
            orjson.dumps,
            True,
            True,
        ),
        ("resent", {"messages": M}, {"messages": M}, orjson.dumps, True, True),
        ("spaced-messages-last", {"messages": M}, {"messages": [*M, NEW]}, SPACED, True, True),
        (
            "spaced-fields-after",
            {"messages": M, "system": "s"},
            {"messages": [*M, NEW], "system": "s"},
            SPACED,
            False,
            False,
        ),
        (
            "edited-result",
            {"messages": M},
            {"messages": [*M[:2], {**M[2], "content": "edited"}, NEW]},
            orjson.dumps,
            True,
            False,
        ),
        ("fewer", {"messages": M}, {"messages": M[:2]}, orjson.dumps, True, False),
        ("later-duplicate-key", {"messages": M}, None, orjson.dumps, True, False),
    ],
)
def test_shared_messages_by_bytes_equal_the_parsed_comparison(monkeypatch, case_id, old, new, dumps, found, by_bytes):
    """Where the bytes decide, they say what comparing the parsed messages says; elsewhere (the end
    of the list not found, an edit, a shorter list, a second "messages" key whose list the parser
    keeps) the parsed messages are compared."""
    a_raw = dumps(old)
    b_raw = dumps(new) if new is not None else a_raw[:-1] + b',"messages":' + orjson.dumps([M[0], NEW]) + b"}"
    a, b = (split_request(orjson.loads(r), "messages", ("system",), r) for r in (a_raw, b_raw))
    assert (a.messages_end > 0 and a_raw[a.messages_end : a.messages_end + 1] == b"]") == found, case_id
    walked = []
    monkeypatch.setattr(conversation, "num_shared", lambda x, y: walked.append(1) or num_shared(x, y))
    assert num_shared_messages(a, b) == num_shared(a.messages, b.messages), case_id
    assert (not walked) == by_bytes, case_id
