"""The OpenAI Responses API front end (pure): request parsing, responses, stream events, errors.

What OpenAI's Codex CLI speaks (`POST /v1/responses`, always streamed, `store: false`, the whole
conversation in `input` every call). Mapping to the chat template: `instructions` and a leading
`system`/`developer` message become the system message (later ones render as user turns); a
`message` item's text parts are joined; an assistant `message` item and the `function_call` items
after it are one assistant turn (as the model produced them: text, then calls), so a turn the
proxy served renders from its remembered ids; `function_call_output` items become `tool` messages
and must answer a call of the turn before; `reasoning` items are dropped (the template has no
reasoning turn). Only `function` tools exist for the template: a `namespace` tool's functions are
offered by name; hosted tools (`web_search`, ...) run on OpenAI's servers, which a model served
here cannot call, so they are left out (Codex sends `web_search` on every call); `custom` and other
client tool types are refused. Stateless: `previous_response_id` is refused (nothing is stored).
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
from gyre.proxy.openai import ERROR_TYPES, error_status, new_call_id
from gyre.proxy.wire import BaseStream, BaseWire, Event, Usage, split_request


def make_error(err: ApiError) -> dict:
    kind, code = ERROR_TYPES[err.kind]
    return {"error": {"message": err.message, "type": kind, "param": None, "code": code}}


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    require_type(content, list, where, "a string or a list of content parts")
    parts = []
    for j, p in enumerate(content):
        require_type(p, dict, f"{where}[{j}]", "a content part object")
        kind = p.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append(require_type(p.get("text"), str, f"{where}[{j}].text", "a string"))
        elif kind in ("input_image", "input_file"):
            parts.append("[image]" if kind == "input_image" else "[file]")
        elif kind != "refusal":
            raise invalid(f"{where}[{j}].type: {kind!r} is not supported; valid: input_text, output_text, input_image")
    return "\n".join(parts)


def _call(item: dict, where: str) -> dict:
    name = require_type(item.get("name"), str, f"{where}.name", "a string")
    call_id = require_type(item.get("call_id"), str, f"{where}.call_id", "a string")
    raw = item.get("arguments") or "{}"
    try:
        args = jsonio.loads(raw) if isinstance(raw, str) else raw
    except jsonio.DecodeError as e:
        raise invalid(f"{where}.arguments: not valid JSON ({e})") from None
    require_type(args, dict, f"{where}.arguments", "a JSON object")
    return {"id": call_id, "name": name, "arguments": args}


def _step(i: int, item, out: list[dict], state: tuple) -> tuple:
    """One input item. The state: (the open assistant turn as (text, calls) or None, call ids a
    function_call_output may answer). A turn is emitted when the next non-call item closes it."""
    turn, pending = state
    where = f"input[{i}]"
    require_type(item, dict, where, "an object")
    kind = item.get("type", "message")
    if kind == "function_call":
        text, calls = turn or ("", ())
        return (text, (*calls, _call(item, where))), pending
    if turn is not None:
        pending = _close(out, turn)
    if kind == "reasoning":
        return None, pending
    if kind == "function_call_output":
        cid = item.get("call_id")
        if cid not in pending:
            raise invalid(
                f"{where}.call_id: {cid!r} does not answer a function_call of the turn before "
                f"(ids: {sorted(pending) or 'none'})"
            )
        output = item.get("output")
        out.append(
            {
                "role": "tool",
                "content": _text(output if output is not None else "", f"{where}.output"),
                "tool_call_id": cid,
            }
        )
        return None, pending
    if kind != "message":
        raise invalid(
            f"{where}.type: {kind!r} is not supported; valid: message, function_call, function_call_output, reasoning"
        )
    role, text = item.get("role"), _text(item.get("content", ""), f"{where}.content")
    if role == "assistant":
        return (text, ()), frozenset()
    if role in ("system", "developer"):
        out.append({"role": "system" if not out else "user", "content": text})
    elif role == "user":
        out.append({"role": "user", "content": text})
    else:
        raise invalid(f"{where}.role: {role!r} is not one of user, assistant, system, developer")
    return None, frozenset()


def _close(out: list[dict], turn: tuple) -> frozenset:
    text, calls = turn
    msg = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = list(calls)
    out.append(msg)
    return frozenset(c["id"] for c in calls)


def _finish(out: list[dict], state: tuple) -> list[dict]:
    return out + [_assistant(state[0])] if state[0] is not None else out


def _assistant(turn: tuple) -> dict:
    text, calls = turn
    return {"role": "assistant", "content": text, **({"tool_calls": list(calls)} if calls else {})}


def _convert_input(body: dict, resume: Resume | None) -> tuple[list[dict], list]:
    instructions = body.get("instructions")
    head = (
        [{"role": "system", "content": require_type(instructions, str, "instructions", "a string")}]
        if instructions
        else []
    )
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    require_type(items, list, "input", "a string or a list of items")
    if not items:
        raise invalid("input: at least one item is required")
    out, marks = convert_messages(items, _step, (None, frozenset()), head, resume)
    return _finish(out, marks[-1][1]), marks


HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation", "mcp")
"""Tool types OpenAI runs on its side: not offered to a model served here (see module doc)."""


def _convert_tools(tools, where: str = "tools") -> list[dict] | None:
    if tools is None:
        return None
    require_type(tools, list, where, "an array")
    out = []
    for i, t in enumerate(tools):
        require_type(t, dict, f"{where}[{i}]", "an object")
        kind = t.get("type")
        if kind == "namespace":
            out += _convert_tools(t.get("tools") or [], f"{where}[{i}].tools") or []
            continue
        if kind in HOSTED_TOOLS:
            continue
        if kind != "function":
            raise invalid(
                f"{where}[{i}].type: {kind!r} is not supported; valid: function, namespace (hosted tools are left out)"
            )
        name = require_type(t.get("name"), str, f"{where}[{i}].name", "a string")
        schema = check_tool_schema(t.get("parameters") or {"type": "object"}, f"{where}[{i}].parameters")
        out.append(
            {
                "type": "function",
                "function": {"name": name, "description": t.get("description") or "", "parameters": schema},
            }
        )
    return out or None


def parse_request(body, models: list[str], default_max_tokens: int, resume: Resume | None = None) -> ChatRequest:
    """A validated ChatRequest from a /v1/responses body.

    Raises:
        ApiError: invalid_request naming the field, or not_found for an unknown model.
    """
    model = require_model(body, models)
    if body.get("previous_response_id") is not None:
        raise invalid("previous_response_id: responses are not stored here; send the whole conversation in input")
    sampling = check_sampling(body, max_tokens_key="max_output_tokens", default_max_tokens=default_max_tokens)
    stream = body.get("stream", False)
    require_type(stream, bool, "stream", "a boolean")
    messages, marks = _convert_input(body, resume)
    return ChatRequest(
        model=model, messages=messages, tools=_convert_tools(body.get("tools")), stream=stream, marks=marks, **sampling
    )


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex[:24]


def make_usage(usage: Usage) -> dict:
    return {
        "input_tokens": usage.input,
        "input_tokens_details": {"cached_tokens": usage.cached},
        "output_tokens": usage.output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.input + usage.output,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = (
        [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    )
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call_id: str, call: ToolCall | None, name: str = "", status: str = "completed") -> dict:
    arguments = jsonio.dumps(call.arguments) if call is not None else ""
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": call.name if call else name,
        "arguments": arguments,
        "status": status,
    }


def make_response(resp_id: str, chat: ChatRequest, output: list[dict], finish: str | None, usage: dict | None) -> dict:
    """The Response object; finish None: still in progress (the stream's first events)."""
    status = "in_progress" if finish is None else ("incomplete" if finish == "length" else "completed")
    return {
        "id": resp_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": chat.model,
        "output": output,
        "usage": usage,
        "error": None,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": None,
        "metadata": {},
        "temperature": chat.temperature,
        "top_p": chat.top_p,
        "max_output_tokens": chat.max_tokens,
        "previous_response_id": None,
        "store": False,
        "tools": [
            {
                "type": "function",
                "name": t["function"]["name"],
                "description": t["function"]["description"],
                "parameters": t["function"]["parameters"],
                "strict": False,
            }
            for t in chat.tools or []
        ],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "reasoning": None,
    }


def output_items(text: str, calls: list[tuple[str, ToolCall]]) -> list[dict]:
    """The output of a non-streamed answer: a message item for the text, one item per call."""
    items = [message_item("msg_" + uuid.uuid4().hex[:24], text)] if text else []
    return items + [call_item("fc_" + uuid.uuid4().hex[:24], cid, c) for cid, c in calls]


class ResponsesStream(BaseStream):
    """The SSE events of one streamed response, numbered in order.

    Items are sequential: a message item (one output_text part) and function_call items open as
    their content arrives, each closing the one before.
    """

    def __init__(self, resp_id: str, chat: ChatRequest):
        self.resp_id, self.chat = resp_id, chat
        self.seq = 0
        self.output: list[dict] = []
        """Items done so far (the completed response's output)."""
        self.open: dict | None = None
        self.open_text = ""
        self.streamed: set[str] = set()

    def _event(self, kind: str, **fields) -> Event:
        self.seq += 1
        return kind, {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[Event]:
        snap = make_response(self.resp_id, self.chat, [], None, None)
        return [self._event("response.created", response=snap), self._event("response.in_progress", response=snap)]

    def _close(self) -> list[Event]:
        item, self.open = self.open, None
        if item is None:
            return []
        k = len(self.output)
        if item["type"] == "message":
            part = {"type": "output_text", "text": self.open_text, "annotations": [], "logprobs": []}
            done = {**item, "status": "completed", "content": [part]}
            events = [
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=k,
                    content_index=0,
                    text=self.open_text,
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done", item_id=item["id"], output_index=k, content_index=0, part=part
                ),
            ]
        else:
            done = {**item, "status": "completed"}
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=k,
                    arguments=item["arguments"],
                    name=item["name"],
                )
            ]
        self.output.append(done)
        return events + [self._event("response.output_item.done", output_index=k, item=done)]

    def _open(self, item: dict) -> list[Event]:
        events = self._close()
        self.open = item
        return events + [
            self._event(
                "response.output_item.added",
                output_index=len(self.output),
                item=dict(item, content=[]) if item["type"] == "message" else dict(item),
            )
        ]

    def text(self, delta: str) -> list[Event]:
        if not delta:
            return []
        events = []
        if self.open is None or self.open["type"] != "message":
            events = self._open(message_item("msg_" + uuid.uuid4().hex[:24], "", status="in_progress"))
            self.open_text = ""
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=self.open["id"],
                    output_index=len(self.output),
                    content_index=0,
                    part=part,
                )
            )
        self.open_text += delta
        return events + [
            self._event(
                "response.output_text.delta",
                item_id=self.open["id"],
                output_index=len(self.output),
                content_index=0,
                delta=delta,
                logprobs=[],
            )
        ]

    def tool_start(self, call_id: str, name: str) -> list[Event]:
        self.streamed.add(call_id)
        return self._open(call_item("fc_" + uuid.uuid4().hex[:24], call_id, None, name, status="in_progress"))

    def tool_args(self, chunk: str) -> list[Event]:
        assert self.open is not None and self.open["type"] == "function_call", "tool_args outside a function_call item"
        if not chunk:
            return []
        self.open["arguments"] += chunk
        return [
            self._event(
                "response.function_call_arguments.delta",
                item_id=self.open["id"],
                output_index=len(self.output),
                delta=chunk,
            )
        ]

    def finish(self, calls: list[tuple[str, ToolCall]], finish: str, usage: Usage) -> list[Event]:
        events = self._close()
        for cid, c in calls:
            if cid not in self.streamed:
                events += self.tool_start(cid, c.name) + self.tool_args(jsonio.dumps(c.arguments)) + self._close()
        done = make_response(self.resp_id, self.chat, self.output, finish, make_usage(usage))
        return events + [
            self._event(
                "response.incomplete" if done["status"] == "incomplete" else "response.completed", response=done
            )
        ]


class ResponsesWire(BaseWire):
    """OpenAI's Responses API (what Codex CLI speaks); hints as for chat completions."""

    name = "responses"

    def split(self, body, raw: bytes = b"") -> WireRequest | None:
        return split_request(body, "input", ("instructions", "tools"), raw)

    def parse(self, body, resume: Resume | None = None) -> ChatRequest:
        return parse_request(body, self.models, self.default_max_tokens, resume)

    def hints(self, headers, body: dict, chat: ChatRequest) -> CallHints:
        return openai_hints(headers, body)

    def error(self, err: ApiError) -> tuple[int, dict]:
        return error_status(err), make_error(err)

    def new_call_id(self) -> str:
        return new_call_id()

    def response(self, chat: ChatRequest, text, calls, finish, usage: Usage) -> dict:
        return make_response(new_response_id(), chat, output_items(text, calls), finish, make_usage(usage))

    def stream(self, chat: ChatRequest, usage: Usage) -> ResponsesStream:
        return ResponsesStream(new_response_id(), chat)

    def stream_error(self, err: ApiError) -> list[Event]:
        kind, code = ERROR_TYPES[err.kind]
        return [("error", {"type": "error", "code": code or kind, "message": err.message, "param": None})]
