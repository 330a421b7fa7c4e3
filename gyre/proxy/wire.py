"""The two wire formats as small hooks the call lifecycle (gyre.proxy.calls) fills in (pure).

Each hook object parses a body, reads the harness hints, names its tool-call ids, and turns the
proxy's result (text, tool calls, finish, token counts) into its API's response, stream events
(as (event name or None, JSON text) pairs) and error bodies. `OutputStream` turns a growing output
into stream events: text once it is safe to show, tool calls as their tokens arrive.
"""

import json
import logging
import re
from dataclasses import dataclass

import orjson

from gyre.models.tokenizer import ParsedAssistant, ToolCall, parse_assistant_text
from gyre.proxy import anthropic, openai, responses
from gyre.proxy.chat import ApiError, ChatRequest, Resume
from gyre.proxy.conversation import WireRequest
from gyre.proxy.hints import CallHints, anthropic_hints, openai_hints

_MARKERS = ("<tool_call>", "<|im_end|>", "<|endoftext|>")


def _js(obj) -> str:
    """One event's JSON (orjson: a few times faster than json.dumps, the same compact JSON)."""
    return orjson.dumps(obj).decode()


def streamable_text(text: str) -> str:
    """The part of decoded output that can be shown already: before any tool call or end marker,
    without a trailing partial marker or partial UTF-8 character, and stripped of whitespace (the
    final content is stripped; trailing whitespace shows once more text follows it)."""
    cut = min([i for i in (text.find(m) for m in _MARKERS) if i >= 0], default=len(text))
    text = text[:cut]
    for m in _MARKERS:
        for k in range(len(m) - 1, 0, -1):
            if text.endswith(m[:k]):
                text = text[:-k]
                break
    return text.rstrip("\ufffd").strip()


class IncrementalText:
    """Decoded output text kept up to date per chunk without re-decoding all ids each time (a long
    output would cost O(n^2)); a tail ending in a partial UTF-8 character is re-decoded next time."""

    def __init__(self, decode):
        self.decode, self.stable, self.num_stable = decode, "", 0

    def update(self, ids: list[int]) -> str:
        tail = self.decode(ids[self.num_stable :])
        if tail.endswith("\ufffd"):
            return self.stable + tail
        self.stable, self.num_stable = self.stable + tail, len(ids)
        return self.stable


log = logging.getLogger(__name__)

_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')
"""The start of a tool call as the template asks for it: name first, then an arguments object."""


@dataclass
class _Occurrence:
    """One `<tool_call>` of the output, as far as it has arrived."""

    body_start: int
    name: str | None = None
    args_start: int = -1
    args_end: int = -1
    """End of the arguments object (-1 until its closing brace arrived)."""
    sent: int = -1
    """Text position up to which the arguments were streamed."""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    arguments: str = ""
    """The arguments text streamed so far."""
    body: str | None = None
    """The whole body once `</tool_call>` arrived."""


class ToolCallScanner:
    """Finds tool calls in output text as it grows: for each `<tool_call>` whose JSON begins
    `{"name": "...", "arguments": {` (the template's form), the name as soon as it is complete,
    then the raw text of the arguments object chunk by chunk. Calls in another form are reported
    only by the final parse. Each character is scanned once."""

    def __init__(self):
        self.occurrences: list[_Occurrence] = []
        self.pos = 0
        """Where the next `<tool_call>` (or the open call's `</tool_call>`) may start."""
        self.open: _Occurrence | None = None
        self.end = -1
        """Position of `<|im_end|>` once seen: nothing after it is part of the answer."""
        self.end_from = 0

    def _limit(self, text: str) -> int:
        if self.end < 0:
            self.end = text.find("<|im_end|>", self.end_from)
            self.end_from = max(0, len(text) - len("<|im_end|>") + 1)
        return self.end if self.end >= 0 else len(text.rstrip("\ufffd"))

    def _find(self, text: str, marker: str, limit: int) -> int:
        """`marker` at or after self.pos and before `limit`; remembers how far it looked."""
        i = text.find(marker, self.pos, limit)
        if i < 0:
            self.pos = max(self.pos, limit - len(marker) + 1)
        return i

    def update(self, text: str) -> list[tuple[str, int, str]]:
        """Events since the last update: ("start", k, name) and ("args", k, json chunk), k = occurrence index."""
        limit = self._limit(text)
        events: list[tuple[str, int, str]] = []
        while True:
            if self.open is None:
                i = self._find(text, "<tool_call>", limit)
                if i < 0:
                    return events
                self.open = _Occurrence(i + len("<tool_call>"))
                self.occurrences.append(self.open)
                self.pos = self.open.body_start
            oc, k = self.open, len(self.occurrences) - 1
            close = self._find(text, "</tool_call>", limit)
            avail = close if close >= 0 else limit
            if oc.name is None and oc.args_start < 0:
                self._head(text, oc, avail, close >= 0, k, events)
            if oc.name is not None and oc.args_end < 0:
                self._scan(text, oc, avail)
                upto = oc.args_end if oc.args_end >= 0 else avail
                if upto > oc.sent:
                    events.append(("args", k, text[oc.sent : upto]))
                    oc.arguments += text[oc.sent : upto]
                    oc.sent = upto
            if close < 0:
                return events
            oc.body = text[oc.body_start : close]
            self.pos, self.open = close + len("</tool_call>"), None

    @staticmethod
    def _head(text: str, oc: _Occurrence, avail: int, closed: bool, k: int, events: list) -> None:
        m = _CALL_HEAD.match(text, oc.body_start, avail)
        if m is None:
            if closed or not _could_be_head(text[oc.body_start : avail]):
                oc.args_start = avail  # another form: left to the final parse
            return
        try:
            oc.name = json.loads('"' + m.group(1) + '"')
        except ValueError:
            oc.args_start = avail
            return
        oc.args_start = oc.sent = m.end()
        events.append(("start", k, oc.name))

    @staticmethod
    def _scan(text: str, oc: _Occurrence, avail: int) -> None:
        """Advance the arguments object's brace depth (strings and escapes respected) up to `avail`."""
        for j in range(max(oc.sent, oc.args_start), avail):
            c = text[j]
            if oc.in_string:
                if oc.escaped:
                    oc.escaped = False
                elif c == "\\":
                    oc.escaped = True
                elif c == '"':
                    oc.in_string = False
            elif c == '"':
                oc.in_string = True
            elif c in "{[":
                oc.depth += 1
            elif c in "}]":
                oc.depth -= 1
                if oc.depth == 0:
                    oc.args_end = j + 1
                    return


_ARGS_KEY = re.compile(r'"arguments"\s*:\s*\S')


def _could_be_head(prefix: str) -> bool:
    """Whether a body prefix that does not match `_CALL_HEAD` yet still may (its arguments value
    has not begun, and it is not absurdly long for a name)."""
    return len(prefix) < 4096 and _ARGS_KEY.search(prefix) is None


class OutputStream:
    """One streamed answer's events from its growing output ids (pure): text while it is safe to
    show (see `streamable_text`), then each tool call as its tokens arrive (name, then argument
    JSON chunks). The final parse decides the answer, as without streaming: `result` pairs it with
    what was streamed. A streamed call that the final parse rejects (the model broke its JSON after
    the arguments began, or hit max_tokens inside them) stays a tool_use block with the partial
    input sent; the non-streamed answer would show no call there.
    """

    def __init__(self, events, decode, new_call_id):
        self.events, self.new_call_id = events, new_call_id
        self.text, self.scanner = IncrementalText(decode), ToolCallScanner()
        self.shown, self.frozen = "", False
        self.ids: dict[int, str] = {}
        """Occurrence index -> id of a call streamed so far."""

    def update(self, output_ids: list[int]) -> list[tuple[str | None, str]]:
        full = self.text.update(output_ids)
        out = []
        if not self.frozen:
            safe = streamable_text(full)
            self.frozen = any(m in full for m in ("<tool_call>", "<|im_end|>"))
            if safe.startswith(self.shown) and len(safe) > len(self.shown):
                out += self.events.text(safe[len(self.shown) :])
                self.shown = safe
        for kind, k, value in self.scanner.update(full):
            if kind == "start":
                self.ids[k] = self.new_call_id()
                out += self.events.tool_start(self.ids[k], value)
            else:
                out += self.events.tool_args(value)
        return out

    def result(self, parsed: ParsedAssistant) -> tuple[str, list[tuple[str, ToolCall]]]:
        """The answer's text and (id, call)s: the final parse's, streamed calls keeping their ids."""
        text = parsed.content if parsed.content.startswith(self.shown) else self.shown
        occ = self.scanner.occurrences
        valid = [
            k
            for k, oc in enumerate(occ)
            if oc.body is not None and parse_assistant_text(f"<tool_call>{oc.body}</tool_call>").tool_calls
        ]
        if len(valid) != len(parsed.tool_calls):
            log.warning(
                "streamed tool calls do not line up with the final parse (%d vs %d); sending them whole",
                len(valid),
                len(parsed.tool_calls),
            )
            valid = [-1] * len(parsed.tool_calls)
        calls = []
        for k, c in zip(valid, parsed.tool_calls):
            cid = self.ids.get(k)
            if cid is not None and not _same_call(occ[k], c):
                log.warning("streamed tool call %s differs from its final parse; sending it again whole", cid)
                cid = None
            calls.append((cid or self.new_call_id(), c))
        return text, calls

    def finish(
        self, text: str, calls: list[tuple[str, ToolCall]], finish: str, n_in: int, n_out: int
    ) -> list[tuple[str | None, str]]:
        """The rest of the text, the calls not streamed yet, and the wire's closing events."""
        return self.events.text(text[len(self.shown) :]) + self.events.finish(calls, finish, n_in, n_out)


def _same_call(oc: _Occurrence, call: ToolCall) -> bool:
    if oc.name != call.name or oc.args_end < 0:
        return False
    try:
        return json.loads(oc.arguments) == call.arguments
    except ValueError:
        return False


def split_request(body, messages_key: str, head_keys: tuple[str, ...], raw: bytes = b"") -> WireRequest | None:
    """The body as conversation matching sees it; None for one that is not a dict with a message list
    (parsing it answers the error). `raw`: the body's bytes, for `conversation.num_shared_messages`."""
    if not isinstance(body, dict) or not isinstance(body.get(messages_key), list):
        return None
    rest = {k: v for k, v in body.items() if k != messages_key and k != "stream"}
    return WireRequest(
        tuple(body.get(k) for k in head_keys), body[messages_key], rest, raw, _messages_end(body, messages_key, raw)
    )


def _messages_end(body: dict, key: str, raw: bytes) -> int:
    """Where the last item of the list under `key` ends in `raw`: known where the bytes after it are
    the list's "]" and the fields after it as orjson writes them (compact, as harnesses send JSON);
    else -1."""
    if not raw or not body[key]:
        return -1
    keys = list(body)
    try:
        after = b"".join(b"," + orjson.dumps(k) + b":" + orjson.dumps(body[k]) for k in keys[keys.index(key) + 1 :])
    except orjson.JSONEncodeError:
        return -1
    tail = b"]" + after + b"}"
    return len(raw) - len(tail) if raw.endswith(tail) else -1


class AnthropicWire:
    name = "anthropic"

    def __init__(self, models: list[str], default_max_tokens: int):
        self.models = models

    def split(self, body, raw: bytes = b"") -> WireRequest | None:
        return split_request(body, "messages", ("system", "tools"), raw)

    def parse(self, body, resume: Resume | None = None) -> ChatRequest:
        return anthropic.parse_request(body, self.models, resume)

    def hints(self, headers, body: dict, chat: ChatRequest) -> CallHints:
        return anthropic_hints(headers, body, anthropic.summary_request(body), bool(chat.tools))

    def error(self, err: ApiError) -> tuple[int, dict]:
        return err.status, anthropic.make_error(err)

    def new_call_id(self) -> str:
        return anthropic.new_tool_id()

    def response(self, chat: ChatRequest, text, calls, finish, n_in, n_out) -> dict:
        return anthropic.make_response(
            anthropic.new_message_id(), chat.model, text, calls, finish, anthropic.make_usage(n_in, n_out)
        )

    def stream(self, chat: ChatRequest, n_in: int) -> "AnthropicStream":
        return AnthropicStream(anthropic.StreamEvents(anthropic.new_message_id(), chat.model, n_in))

    def stream_error(self, err: ApiError) -> list[tuple[str | None, str]]:
        return [("error", json.dumps(anthropic.make_error(err)))]


class NamedEventStream:
    """SSE events with names (the Messages and Responses APIs): each event builder's output as
    (event name, JSON text); subclasses add `finish`, whose usage shape differs per API."""

    def __init__(self, events):
        self.ev = events

    def start(self):
        return [(n, _js(d)) for n, d in self.ev.start()]

    def text(self, delta: str):
        return [(n, _js(d)) for n, d in self.ev.text(delta)]

    def tool_start(self, call_id: str, name: str):
        return [(n, _js(d)) for n, d in self.ev.tool_start(call_id, name)]

    def tool_args(self, chunk: str):
        return [(n, _js(d)) for n, d in self.ev.tool_args(chunk)]


class AnthropicStream(NamedEventStream):
    def finish(self, calls: list[tuple[str, ToolCall]], finish: str, n_in: int, n_out: int):
        return [(n, _js(d)) for n, d in self.ev.finish(calls, finish, n_out)]


class OpenAIWire:
    name = "openai"

    def __init__(self, models: list[str], default_max_tokens: int):
        self.models, self.default_max_tokens = models, default_max_tokens

    def split(self, body, raw: bytes = b"") -> WireRequest | None:
        return split_request(body, "messages", ("tools",), raw)

    def parse(self, body, resume: Resume | None = None) -> ChatRequest:
        return openai.parse_request(body, self.models, self.default_max_tokens, resume)

    def hints(self, headers, body: dict, chat: ChatRequest) -> CallHints:
        return openai_hints(headers, body)

    def error(self, err: ApiError) -> tuple[int, dict]:
        return openai.error_status(err), openai.make_error(err)

    def new_call_id(self) -> str:
        return openai.new_call_id()

    def response(self, chat: ChatRequest, text, calls, finish, n_in, n_out) -> dict:
        return openai.make_response(
            openai.new_completion_id(), chat.model, text, calls, finish, openai.make_usage(n_in, n_out)
        )

    def stream(self, chat: ChatRequest, n_in: int) -> "OpenAIStream":
        return OpenAIStream(openai.StreamChunks(openai.new_completion_id(), chat.model, chat.include_usage))

    def stream_error(self, err: ApiError) -> list[tuple[str | None, str]]:
        return [(None, json.dumps(openai.make_error(err))), (None, "[DONE]")]


class OpenAIStream:
    def __init__(self, chunks: openai.StreamChunks):
        self.ch = chunks

    def start(self):
        return [(None, _js(c)) for c in self.ch.start()]

    def text(self, delta: str):
        return [(None, _js(c)) for c in self.ch.text(delta)]

    def tool_start(self, call_id: str, name: str):
        return [(None, _js(c)) for c in self.ch.tool_start(call_id, name)]

    def tool_args(self, chunk: str):
        return [(None, _js(c)) for c in self.ch.tool_args(chunk)]

    def finish(self, calls, finish: str, n_in: int, n_out: int):
        chunks = self.ch.finish(calls, finish, openai.make_usage(n_in, n_out))
        return [(None, _js(c)) for c in chunks] + [(None, "[DONE]")]


class ResponsesWire:
    """OpenAI's Responses API (what Codex CLI speaks); hints as for chat completions."""

    name = "responses"

    def __init__(self, models: list[str], default_max_tokens: int):
        self.models, self.default_max_tokens = models, default_max_tokens

    def split(self, body, raw: bytes = b"") -> WireRequest | None:
        return split_request(body, "input", ("instructions", "tools"), raw)

    def parse(self, body, resume: Resume | None = None) -> ChatRequest:
        return responses.parse_request(body, self.models, self.default_max_tokens, resume)

    def hints(self, headers, body: dict, chat: ChatRequest) -> CallHints:
        return openai_hints(headers, body)

    def error(self, err: ApiError) -> tuple[int, dict]:
        return openai.error_status(err), responses.make_error(err)

    def new_call_id(self) -> str:
        return responses.new_call_id()

    def response(self, chat: ChatRequest, text, calls, finish, n_in, n_out) -> dict:
        return responses.make_response(
            responses.new_response_id(),
            chat,
            responses.output_items(text, calls),
            finish,
            responses.make_usage(n_in, n_out),
        )

    def stream(self, chat: ChatRequest, n_in: int) -> "ResponsesStream":
        return ResponsesStream(responses.StreamEvents(responses.new_response_id(), chat))

    def stream_error(self, err: ApiError) -> list[tuple[str | None, str]]:
        kind, code = openai.ERROR_TYPES[err.kind]
        return [("error", json.dumps({"type": "error", "code": code or kind, "message": err.message, "param": None}))]


class ResponsesStream(NamedEventStream):
    def finish(self, calls, finish: str, n_in: int, n_out: int):
        return [(n, _js(d)) for n, d in self.ev.finish(calls, finish, responses.make_usage(n_in, n_out))]
