"""The OpenAI chat completions front end (pure): request parsing, responses, stream chunks, errors.

Messages map one to one onto the chat template (`system`/`developer` first becomes the system
message, later ones render as user turns); assistant `tool_calls[].function.arguments` (a JSON
string) become argument objects; `tool` messages must answer a tool call id of the preceding
assistant message.
"""

import time
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
    require_model,
    require_type,
)
from gyre.proxy.conversation import WireRequest
from gyre.proxy.hints import CallHints, openai_hints
from gyre.proxy.wire import BaseStream, BaseWire, Event, Usage, split_request

ERROR_TYPES = {
    "invalid_request": ("invalid_request_error", None),
    "authentication": ("invalid_request_error", "invalid_api_key"),
    "permission": ("invalid_request_error", "permission_denied"),
    "not_found": ("invalid_request_error", "model_not_found"),
    "too_large": ("invalid_request_error", "context_length_exceeded"),
    "overloaded": ("server_error", "overloaded"),
    "api_error": ("server_error", None),
}


def make_error(err: ApiError) -> dict:
    kind, code = ERROR_TYPES[err.kind]
    return {"error": {"message": err.message, "type": kind, "param": None, "code": code}}


def error_status(err: ApiError) -> int:
    """OpenAI clients retry 429/5xx; an overloaded proxy answers 503."""
    return 503 if err.kind == "overloaded" else err.status


def _content_text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    require_type(content, list, where, "a string or a list of content parts")
    parts = []
    for j, p in enumerate(content):
        require_type(p, dict, f"{where}[{j}]", "a content part object")
        if p.get("type") == "text":
            parts.append(require_type(p.get("text"), str, f"{where}[{j}].text", "a string"))
        elif p.get("type") == "image_url":
            parts.append("[image]")
        else:
            raise invalid(f"{where}[{j}]: unsupported content part type {p.get('type')!r}; valid: text, image_url")
    return "\n".join(parts)


def _tool_calls(calls, where: str) -> list[dict]:
    require_type(calls, list, where, "a list")
    out = []
    for j, c in enumerate(calls):
        require_type(c, dict, f"{where}[{j}]", "an object")
        fn = require_type(c.get("function"), dict, f"{where}[{j}].function", "an object")
        name = require_type(fn.get("name"), str, f"{where}[{j}].function.name", "a string")
        raw = fn.get("arguments") or "{}"
        try:
            args = jsonio.loads(raw) if isinstance(raw, str) else raw
        except jsonio.DecodeError as e:
            raise invalid(f"{where}[{j}].function.arguments: not valid JSON ({e})") from None
        require_type(args, dict, f"{where}[{j}].function.arguments", "a JSON object")
        out.append({"id": str(c.get("id")), "name": name, "arguments": args})
    return out


def _convert_step(i: int, m, out: list[dict], pending: frozenset[str]) -> frozenset[str]:
    """One wire message into `out`; the state is the tool call ids a `tool` message may answer."""
    require_type(m, dict, f"messages[{i}]", "an object")
    role, where = m.get("role"), f"messages[{i}]"
    text = _content_text(m.get("content"), f"{where}.content")
    if role in ("system", "developer"):
        out.append({"role": "system" if not out else "user", "content": text})
    elif role == "user":
        out.append({"role": "user", "content": text})
    elif role == "assistant":
        msg = {"role": "assistant", "content": text}
        if m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        out.append(msg)
        return frozenset(c["id"] for c in msg.get("tool_calls", []))
    elif role == "tool":
        tid = m.get("tool_call_id")
        if tid not in pending:
            raise invalid(
                f"{where}.tool_call_id: {tid!r} does not answer a tool call of the preceding "
                f"assistant message (ids: {sorted(pending) or 'none'})"
            )
        out.append({"role": "tool", "content": text, "tool_call_id": tid})
        return pending
    else:
        raise invalid(f"{where}.role: {role!r} is not one of system, developer, user, assistant, tool")
    return frozenset()


def _convert_messages(messages, resume: Resume | None = None) -> tuple[list[dict], list]:
    require_type(messages, list, "messages", "an array")
    if not messages:
        raise invalid("messages: at least one message is required")
    return convert_messages(messages, _convert_step, frozenset(), [], resume)


def _convert_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    require_type(tools, list, "tools", "an array")
    out = []
    for i, t in enumerate(tools):
        require_type(t, dict, f"tools[{i}]", "an object")
        if t.get("type", "function") != "function":
            raise invalid(f"tools[{i}].type: {t.get('type')!r} is not supported; valid: function")
        fn = require_type(t.get("function"), dict, f"tools[{i}].function", "an object")
        name = require_type(fn.get("name"), str, f"tools[{i}].function.name", "a string")
        schema = check_tool_schema(fn.get("parameters", {"type": "object"}), f"tools[{i}].function.parameters")
        out.append(
            {
                "type": "function",
                "function": {"name": name, "description": fn.get("description", ""), "parameters": schema},
            }
        )
    return out or None


def parse_request(body, models: list[str], default_max_tokens: int, resume: Resume | None = None) -> ChatRequest:
    """A validated ChatRequest from a /v1/chat/completions body.

    Raises:
        ApiError: invalid_request naming the field, or not_found for an unknown model.
    """
    model = require_model(body, models)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sampling = check_sampling(body, max_tokens_key=key, default_max_tokens=default_max_tokens)
    if body.get("n", 1) != 1:
        raise invalid(f"n: only n=1 is supported, got {body.get('n')!r}")
    stream = body.get("stream", False)
    require_type(stream, bool, "stream", "a boolean")
    opts = body.get("stream_options") or {}
    require_type(opts, dict, "stream_options", "an object")
    messages, marks = _convert_messages(body.get("messages"), resume)
    return ChatRequest(
        model=model,
        messages=messages,
        tools=_convert_tools(body.get("tools")),
        stream=stream,
        include_usage=bool(opts.get("include_usage")),
        marks=marks,
        **sampling,
    )


def new_completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def finish_reason(finish: str, calls: list) -> str:
    return "tool_calls" if calls else ("length" if finish == "length" else "stop")


def make_usage(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.input,
        "completion_tokens": usage.output,
        "total_tokens": usage.input + usage.output,
        "prompt_tokens_details": {"cached_tokens": usage.cached},
    }


def _wire_calls(calls: list[tuple[str, ToolCall]], with_index: bool) -> list[dict]:
    return [
        {
            **({"index": i} if with_index else {}),
            "id": cid,
            "type": "function",
            "function": {"name": c.name, "arguments": jsonio.dumps(c.arguments)},
        }
        for i, (cid, c) in enumerate(calls)
    ]


def make_response(cid: str, model: str, text: str, calls: list[tuple[str, ToolCall]], finish: str, usage: dict) -> dict:
    msg = {"role": "assistant", "content": text or None}
    if calls:
        msg["tool_calls"] = _wire_calls(calls, with_index=False)
    choice = {"index": 0, "message": msg, "finish_reason": finish_reason(finish, calls), "logprobs": None}
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


class OpenAIStream(BaseStream):
    """The `chat.completion.chunk` objects of one streamed completion, then `[DONE]`; a tool call
    streams as its id and name with empty arguments, then argument text deltas (as OpenAI sends them)."""

    def __init__(self, cid: str, model: str, include_usage: bool):
        self.cid, self.model, self.include_usage = cid, model, include_usage
        self.created = int(time.time())
        self.streamed: set[str] = set()
        self.num_calls = 0

    def _chunk(self, delta: dict, finish: str | None = None) -> dict:
        return {
            "id": self.cid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }

    def start(self) -> list[Event]:
        return [(None, self._chunk({"role": "assistant", "content": ""}))]

    def text(self, delta: str) -> list[Event]:
        return [(None, self._chunk({"content": delta}))] if delta else []

    def tool_start(self, call_id: str, name: str) -> list[Event]:
        self.streamed.add(call_id)
        self.num_calls += 1
        call = {
            "index": self.num_calls - 1,
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        return [(None, self._chunk({"tool_calls": [call]}))]

    def tool_args(self, chunk: str) -> list[Event]:
        if not chunk:
            return []
        return [(None, self._chunk({"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": chunk}}]}))]

    def finish(self, calls: list[tuple[str, ToolCall]], finish: str, usage: Usage) -> list[Event]:
        fresh = [(cid, c) for cid, c in calls if cid not in self.streamed]
        wire = _wire_calls(fresh, with_index=True)
        for w in wire:
            w["index"] += self.num_calls
        out = [self._chunk({"tool_calls": wire})] if wire else []
        out.append(self._chunk({}, finish_reason(finish, calls)))
        if self.include_usage:
            out.append({**self._chunk({}), "choices": [], "usage": make_usage(usage)})
        return [(None, c) for c in out] + [(None, "[DONE]")]


class OpenAIWire(BaseWire):
    name = "openai"

    def split(self, body, raw: bytes = b"") -> WireRequest | None:
        return split_request(body, "messages", ("tools",), raw)

    def parse(self, body, resume: Resume | None = None) -> ChatRequest:
        return parse_request(body, self.models, self.default_max_tokens, resume)

    def hints(self, headers, body: dict, chat: ChatRequest) -> CallHints:
        return openai_hints(headers, body)

    def error(self, err: ApiError) -> tuple[int, dict]:
        return error_status(err), make_error(err)

    def new_call_id(self) -> str:
        return new_call_id()

    def response(self, chat: ChatRequest, text, calls, finish, usage: Usage) -> dict:
        return make_response(new_completion_id(), chat.model, text, calls, finish, make_usage(usage))

    def stream(self, chat: ChatRequest, usage: Usage) -> OpenAIStream:
        return OpenAIStream(new_completion_id(), chat.model, chat.include_usage)

    def stream_error(self, err: ApiError) -> list[Event]:
        return [(None, make_error(err)), (None, "[DONE]")]
