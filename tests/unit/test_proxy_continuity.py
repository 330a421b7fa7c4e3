"""Proxy continuity: turn memory and numbering across a proxy restart (from the records alone), and
sub-agent lineage (a sub-agent's spawner, nested or not) in the record hints."""

import asyncio
import json
import time

import numpy as np
import pytest

from gyre.errors import GyreError
from gyre.models.tokenizer import ByteTokenizer
from gyre.proxy.executions import ExecutionRegistry
from gyre.proxy.hints import anthropic_hints, openai_hints
from gyre.proxy.render import Renderer, assistant_key
from gyre.records.record import CallRecord

TOK = ByteTokenizer()
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
MSGS = [{"role": "system", "content": "s" * 80}, {"role": "user", "content": "q"}]


def model_output(text: str, args: str) -> list[int]:
    """What a model might emit: spacing the template would not write (so re-tokenizing drifts)."""
    s = TOK.special_ids
    return (
        list(text.encode())
        + [s["<tool_call>"]]
        + list(f'{{"name":"f","arguments":{args}}}'.encode())
        + [s["</tool_call>"], s["<|im_end|>"]]
    )


def serve(ex, renderer, messages, output_ids, agent_id="main") -> CallRecord:
    """One call as the proxy serves it: render with the execution's memory, record, remember."""
    inp = renderer.render(messages, TOOLS, ex.turns, agent_id).input_ids
    seq, started = ex.begin_call()
    parent = None if agent_id == "main" else "main"
    r = CallRecord.build(
        input_ids=inp,
        output_ids=output_ids,
        logprobs=[-0.5] * len(output_ids),
        versions=[0] * len(output_ids),
        execution_id=ex.execution_id,
        call_id=f"c{seq}",
        seq=seq,
        agent_id=agent_id,
        parent_agent_id=parent,
        kind_hint="main" if parent is None else "subagent",
        finish_reason="stop",
        started_at=started,
        finished_at=time.time(),
    )
    asyncio.run(ex.append(r))
    p = TOK.parse_assistant(output_ids)
    ex.turns.remember(
        assistant_key(p.content, [{"name": c.name, "arguments": c.arguments} for c in p.tool_calls]),
        output_ids,
        agent_id,
    )
    return r


def echoed(text: str, args: dict) -> list[dict]:
    return [
        {"role": "assistant", "content": text, "tool_calls": [{"id": "t", "name": "f", "arguments": args}]},
        {"role": "tool", "content": "r"},
    ]


@pytest.mark.parametrize("how", ["key-file", "re-registered"])
def test_restarted_registry_reuses_recorded_tokens(tmp_path, how):
    renderer = Renderer(TOK)
    reg = ExecutionRegistry(str(tmp_path), fsync=False, parse=TOK.parse_assistant)
    ex = reg.create("e1")
    key = ex.key
    first = serve(ex, renderer, MSGS, model_output("ok ", '{"x": 1}'))
    sub = serve(ex, renderer, MSGS, model_output("ok ", '{"x":1}'), agent_id="a1")  # same turn, other tokens
    reg.close()

    reg2 = ExecutionRegistry(str(tmp_path), fsync=False, parse=TOK.parse_assistant)  # a restarted proxy
    if how == "re-registered":  # the orchestrator lost the key file but re-registers the sandbox's key
        reg2.revoke("e1")
        reg2 = ExecutionRegistry(str(tmp_path), fsync=False, parse=TOK.parse_assistant)
        assert reg2.lookup(key) is None
        reg2.create("e1", key)
    ex2 = reg2.lookup(key)
    assert ex2 is not None and ex2.num_calls == 0
    asyncio.run(ex2.ready())
    assert ex2.num_calls == 2
    history = MSGS + echoed("ok", {"x": 1})
    out = renderer.render(history, TOOLS, ex2.turns, "main")
    served = np.concatenate((first.input_ids, first.output_ids)).tolist()
    assert out.input_ids.tolist()[: len(served)] == served and (out.num_reused, out.num_retokenized) == (1, 0)
    sub_served = np.concatenate((sub.input_ids, sub.output_ids)).tolist()
    assert renderer.render(history, TOOLS, ex2.turns, "a1").input_ids.tolist()[: len(sub_served)] == sub_served
    assert serve(ex2, renderer, history, model_output("done ", "{}")).seq == 2
    reg2.close()
    last = json.loads(ex2.records_path.read_text().splitlines()[-1])
    assert last["input_base"] == first.call_id and last["input_prefix"] == len(served)  # a delta, not a full copy


def test_registry_rejects_bad_or_reused_keys(tmp_path):
    reg = ExecutionRegistry(str(tmp_path), fsync=False, parse=TOK.parse_assistant)
    ex = reg.create("a")
    with pytest.raises(GyreError, match="api_key must match"):
        reg.create("b", "short")
    with pytest.raises(GyreError, match="already in use"):
        reg.create("b", ex.key)
    assert (tmp_path / "a.key").read_text().strip() != ex.key  # only a digest is stored
    assert (tmp_path / "a.key").stat().st_mode & 0o077 == 0
    reg.close()


SUB = {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc_is_subagent=true"}]}


def test_nested_sub_agent_records_its_spawner():
    top = anthropic_hints({"X-Claude-Code-Agent-Id": "a1"}, SUB, False, True)
    nested = anthropic_hints({"X-Claude-Code-Agent-Id": "a2", "X-Claude-Code-Parent-Agent-Id": "a1"}, SUB, False, True)
    encoded = anthropic_hints(
        {"x-claude-code-agent-id": "b%25", "x-claude-code-parent-agent-id": "a%C3%A9"}, SUB, True, True
    )
    assert (top.agent_id, top.parent_agent_id) == ("a1", "main")
    assert (nested.agent_id, nested.parent_agent_id, nested.kind_hint) == ("a2", "a1", "subagent")
    assert (encoded.agent_id, encoded.parent_agent_id, encoded.kind_hint) == ("b%", "a\u00e9", "subagent_summary")
    assert (
        anthropic_hints(
            {"x-claude-code-agent-id": "a3", "x-claude-code-parent-agent-id": "a3"}, SUB, False, True
        ).parent_agent_id
        == "main"
    )
    o = openai_hints({"x-gyre-agent-id": "s2", "x-gyre-parent-agent-id": "s1"}, {})
    assert (o.agent_id, o.parent_agent_id) == ("s2", "s1")
