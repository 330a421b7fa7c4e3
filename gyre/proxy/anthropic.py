"""The Anthropic Messages API front end (pure): request parsing, responses, SSE events, errors.

Mapping to the chat template: `system` (string or text blocks) and a leading `role: "system"`
message become the system message; a later `role: "system"` message (Claude Code sends one
mid-conversation) is rendered in place as a user turn, so earlier turns keep their tokens; user
`tool_result` blocks become `tool` messages (in order, before the user's text); assistant
`tool_use` blocks become tool calls; `thinking` blocks are dropped (the template has no thinking
turn); images become the placeholder text `[image]`.
"""

import re
import uuid

from gyre.common import jsonio
from gyre.models.parse import ToolCall
from gyre.proxy.chat import (
    ApiError,
    ChatRequest,
    Resume,
    check_sampling,
    check_tool_schema,
    convert_messages,
    invalid,
    require_type,
)
from gyre.proxy.conversation import WireRequest
from gyre.proxy.hints import CallHints, anthropic_hints
from gyre.proxy.wire import BaseStream, BaseWire, Event, Usage, split_request

ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "too_large": "request_too_large",
    "overloaded": "overloaded_error",
    "api_error": "api_error",
}


def make_error(err: ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES[err.kind], "message": err.message}}


def _text_of(content, where: str) -> str:
    """Text of a string or a list of blocks (text blocks joined; images as a placeholder)."""
    if isinstance(content, str):
        return content
    require_type(content, list, where, "a string or a list of content blocks")
    parts = []
    for j, b in enumerate(content):
        require_type(b, dict, f"{where}.{j}", "a content block object")
        if b.get("type") == "text":
            parts.append(require_type(b.get("text"), str, f"{where}.{j}.text", "a string"))
        elif b.get("type") == "image":
            parts.append("[image]")
        else:
            raise invalid(f"{where}.{j}: unsupported block type {b.get('type')!r} here; valid: text, image")
    return "\n".join(parts)


def _user_messages(content, i: int, pending_ids: set[str]) -> list[dict]:
    where = f"messages.{i}.content"
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    require_type(content, list, where, "a string or a list of content blocks")
    tools, texts = [], []
    for j, b in enumerate(content):
        require_type(b, dict, f"{where}.{j}", "a content block object")
        if b.get("type") == "tool_result":
            tid = b.get("tool_use_id")
            if tid not in pending_ids:
                raise invalid(
                    f"{where}.{j}: tool_result.tool_use_id {tid!r} does not match any tool_use block "
                    f"of the previous assistant message (ids: {sorted(pending_ids) or 'none'})"
                )
            text = _text_of(b.get("content") or "", f"{where}.{j}.content")
            tools.append(
                {"role": "tool", "content": ("Error: " + text) if b.get("is_error") else text, "tool_call_id": tid}
            )
        elif b.get("type") in ("text", "image"):
            texts.append(_text_of([b], where))
        elif b.get("type") not in ("thinking", "redacted_thinking", "document"):
            raise invalid(f"{where}.{j}: unsupported block type {b.get('type')!r} in a user message")
    return tools + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _assistant_message(content, i: int) -> tuple[dict, set[str]]:
    where = f"messages.{i}.content"
    if isinstance(content, str):
        return {"role": "assistant", "content": content}, set()
    require_type(content, list, where, "a string or a list of content blocks")
    texts, calls = [], []
    for j, b in enumerate(content):
        require_type(b, dict, f"{where}.{j}", "a content block object")
        kind = b.get("type")
        if kind == "text":
            texts.append(require_type(b.get("text"), str, f"{where}.{j}.text", "a string"))
        elif kind == "tool_use":
            name = require_type(b.get("name"), str, f"{where}.{j}.name", "a string")
            args = require_type(b.get("input", {}), dict, f"{where}.{j}.input", "an object")
            calls.append({"id": str(b.get("id")), "name": name, "arguments": args})
        elif kind not in ("thinking", "redacted_thinking"):
            raise invalid(f"{where}.{j}: unsupported block type {kind!r} in an assistant message")
    msg = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    return msg, {c["id"] for c in calls}


def _convert_step(i: int, m, out: list[dict], pending: frozenset[str]) -> frozenset[str]:
    """One wire message into `out`; the state is the tool_use ids a user message may answer."""
    require_type(m, dict, f"messages.{i}", "an object")
    role = m.get("role")
    if role == "system":
        text = _text_of(m.get("content", ""), f"messages.{i}.content")
        out.append({"role": "system" if not out else "user", "content": text})
        return pending
    if role == "user":
        out += _user_messages(m.get("content", ""), i, pending)
        return frozenset()
    if role == "assistant":
        msg, ids = _assistant_message(m.get("content", ""), i)
        out.append(msg)
        return frozenset(ids)
    raise invalid(f"messages.{i}.role: {role!r} is not one of 'user', 'assistant', 'system'")


def _convert_messages(messages, system: str | None, resume: Resume | None = None) -> tuple[list[dict], list]:
    require_type(messages, list, "messages", "a list")
    if not messages:
        raise invalid("messages: at least one message is required")
    head = [{"role": "system", "content": system}] if system is not None else []
    return convert_messages(messages, _convert_step, frozenset(), head, resume)


def _convert_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    require_type(tools, list, "tools", "a list")
    out = []
    for i, t in enumerate(tools):
        require_type(t, dict, f"tools.{i}", "an object")
        name = require_type(t.get("name"), str, f"tools.{i}.name", "a string")
        if "input_schema" not in t:  # server tools (web search, ...) have no schema; not supported
            raise invalid(f"tools.{i}: tool {name!r} has no input_schema (server tools are not supported)")
        schema = check_tool_schema(t["input_schema"], f"tools.{i}.input_schema")
        out.append(
            {
                "type": "function",
                "function": {"name": name, "description": t.get("description", ""), "parameters": schema},
            }
        )
    return out or None


def parse_request(body, models: list[str], resume: Resume | None = None) -> ChatRequest:
    """A validated ChatRequest from a /v1/messages body (converting only the messages after
    `resume.num_raw`, when a previous call of the conversation shares them and the system prompt).

    Raises:
        ApiError: invalid_request naming the field, or not_found for an unknown model.
    """
    require_type(body, dict, "body", "a JSON object")
    model = require_type(body.get("model"), str, "model", "a string")
    if model not in models:
        raise ApiError("not_found", f"model: {model!r} is not served here; available: {', '.join(models)}")
    system = body.get("system")
    system = None if system is None else _text_of(system, "system")
    sampling = check_sampling(body, max_tokens_key="max_tokens", default_max_tokens=None)
    stream = body.get("stream", False)
    require_type(stream, bool, "stream", "a boolean")
    messages, marks = _convert_messages(body.get("messages"), system, resume)
    return ChatRequest(
        model=model, messages=messages, tools=_convert_tools(body.get("tools")), stream=stream, marks=marks, **sampling
    )


_NO_TOOLS = re.compile(r"(?i)\b(do not|don't|must not|never) (call|use) (any )?tools\b")


def summary_request(body: dict) -> bool:
    """Claude Code's compaction request: the last user message ends with a text block asking for
    a summary and telling the model not to call tools ("Do NOT call any tools")."""
    msgs = body.get("messages") or []
    last = msgs[-1] if msgs and isinstance(msgs[-1], dict) else {}
    content = last.get("content")
    text = content if isinstance(content, str) else ""
    if isinstance(content, list) and content and isinstance(content[-1], dict):
        text = str(content[-1].get("text", ""))
    return last.get("role") == "user" and "summary" in text.lower() and _NO_TOOLS.search(text) is not None


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def new_tool_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def stop_reason(finish: str, calls: list[ToolCall]) -> str:
    return "tool_use" if calls else ("max_tokens" if finish == "length" else "end_turn")


def make_usage(usage: Usage) -> dict:
    """Anthropic counts cache reads apart from `input_tokens` (the three add up to the prompt)."""
    return {
        "input_tokens": usage.input - usage.cached,
        "output_tokens": usage.output,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached,
    }


def make_response(
    msg_id: str, model: str, text: str, calls: list[tuple[str, ToolCall]], finish: str, usage: dict
) -> dict:
    """The non-streaming Message object; `calls` are (tool_use id, call)."""
    content = [{"type": "text", "text": text}] if text else []
    content += [{"type": "tool_use", "id": tid, "name": c.name, "input": c.arguments} for tid, c in calls]
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(finish, [c for _, c in calls]),
        "stop_sequence": None,
        "usage": usage,
    }


class AnthropicStream(BaseStream):
    """The SSE events of one streamed message.

    Blocks are sequential: text and tool_use blocks open as their content arrives, each closing the
    one before.
    """

    def __init__(self, msg_id: str, model: str, usage: Usage):
        self.msg_id, self.model, self.usage = msg_id, model, usage
        self.index = 0
        self.open: str | None = None
        """Type of the block open at `index` (text or tool_use), or None."""
        self.streamed: set[str] = set()

    def start(self) -> list[Event]:
        msg = {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": make_usage(self.usage._replace(output=1)),
        }
        return [("message_start", {"type": "message_start", "message": msg})]

    def _open(self, block: dict) -> list[Event]:
        events = self._close()
        self.open = block["type"]
        return events + [
            ("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        ]

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        self.open = None
        self.index += 1
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index - 1})]

    def _delta(self, delta: dict) -> Event:
        return ("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def text(self, delta: str) -> list[Event]:
        if not delta:
            return []
        events = [] if self.open == "text" else self._open({"type": "text", "text": ""})
        return events + [self._delta({"type": "text_delta", "text": delta})]

    def tool_start(self, tool_id: str, name: str) -> list[Event]:
        """Open a tool_use block whose input follows in `tool_args` chunks."""
        self.streamed.add(tool_id)
        return self._open({"type": "tool_use", "id": tool_id, "name": name, "input": {}})

    def tool_args(self, partial_json: str) -> list[Event]:
        assert self.open == "tool_use", "tool_args outside a tool_use block"
        return [self._delta({"type": "input_json_delta", "partial_json": partial_json})] if partial_json else []

    def finish(self, calls: list[tuple[str, ToolCall]], finish: str, usage: Usage) -> list[Event]:
        events = self._close()
        for tid, c in calls:
            if tid not in self.streamed:
                events += self.tool_start(tid, c.name) + self.tool_args(jsonio.dumps(c.arguments)) + self._close()
        delta = {"stop_reason": stop_reason(finish, [c for _, c in calls]), "stop_sequence": None}
        return events + [
            ("message_delta", {"type": "message_delta", "delta": delta, "usage": make_usage(usage)}),
            ("message_stop", {"type": "message_stop"}),
        ]


class AnthropicWire(BaseWire):
    name = "anthropic"

    def split(self, body, raw: bytes = b"") -> WireRequest | None:
        return split_request(body, "messages", ("system", "tools"), raw)

    def parse(self, body, resume: Resume | None = None) -> ChatRequest:
        return parse_request(body, self.models, resume)

    def hints(self, headers, body: dict, chat: ChatRequest) -> CallHints:
        return anthropic_hints(headers, body, summary_request(body), bool(chat.tools))

    def error(self, err: ApiError) -> tuple[int, dict]:
        return err.status, make_error(err)

    def new_call_id(self) -> str:
        return new_tool_id()

    def response(self, chat: ChatRequest, text, calls, finish, usage: Usage) -> dict:
        return make_response(new_message_id(), chat.model, text, calls, finish, make_usage(usage))

    def stream(self, chat: ChatRequest, usage: Usage) -> AnthropicStream:
        return AnthropicStream(new_message_id(), chat.model, usage)

    def stream_error(self, err: ApiError) -> list[Event]:
        return [("error", make_error(err))]
