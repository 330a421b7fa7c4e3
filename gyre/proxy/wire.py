"""The seam between the call lifecycle (gyre.proxy.calls) and the model APIs (pure).

`BaseWire` is what an API implements (anthropic.AnthropicWire, openai.OpenAIWire,
responses.ResponsesWire): parse a body, read the harness hints, name its tool-call ids, and turn
the proxy's result (text, tool calls, finish, token counts) into its response and error bodies;
its `BaseStream` turns the same result into SSE events. Shared by all APIs: `split_request` (a
body as conversation matching sees it) and `OutputStream`, which drives a stream from the growing
output ids: text once it is safe to show, tool calls as their tokens arrive (gyre.models.parse
decides what is a call, once, for streamed and whole answers alike).
"""

import logging
from abc import ABC, abstractmethod
from typing import NamedTuple

from gyre.common import jsonio
from gyre.common.sse import SseEvent
from gyre.models.parse import ToolCall, ToolCallScanner, streamable_text, text_closed
from gyre.proxy.chat import ApiError, ChatRequest, Resume
from gyre.proxy.conversation import WireRequest
from gyre.proxy.hints import CallHints

log = logging.getLogger(__name__)

Event = SseEvent
"""One SSE event (gyre.common.sse): (event name or None, data: a JSON object, or literal text: `[DONE]`)."""


class Usage(NamedTuple):
    """One call's token counts as the engine reported them, told to the harness in its API's terms."""

    input: int
    output: int
    cached: int = 0
    """Of `input`, the tokens the engine took from its prefix cache (SGLang's `cached_tokens`)."""


class BaseStream(ABC):
    """The SSE events of one streamed answer, built as its content arrives. A tool call streamed
    with `tool_start`/`tool_args` is not sent again by `finish`."""

    @abstractmethod
    def start(self) -> list[Event]: ...

    @abstractmethod
    def text(self, delta: str) -> list[Event]: ...

    @abstractmethod
    def tool_start(self, call_id: str, name: str) -> list[Event]:
        """Open a tool call whose arguments follow in `tool_args` chunks (raw JSON text)."""

    @abstractmethod
    def tool_args(self, chunk: str) -> list[Event]: ...

    @abstractmethod
    def finish(self, calls: list[tuple[str, ToolCall]], finish: str, usage: Usage) -> list[Event]:
        """Close what is open, send the calls not streamed yet, then the stop reason and usage."""


class BaseWire(ABC):
    """One model API: request parsing and its answers' shapes (see the module doc)."""

    name: str
    """The API's name in records (`hints.api`)."""

    def __init__(self, models: list[str], default_max_tokens: int):
        self.models, self.default_max_tokens = models, default_max_tokens

    @abstractmethod
    def split(self, body, raw: bytes = b"") -> WireRequest | None:
        """The body as conversation matching sees it (see `split_request`)."""

    @abstractmethod
    def parse(self, body, resume: Resume | None = None) -> ChatRequest:
        """A validated request, converting only what `resume` does not share.

        Raises:
            ApiError: invalid_request naming the field, or not_found for an unknown model.
        """

    @abstractmethod
    def hints(self, headers, body: dict, chat: ChatRequest) -> CallHints: ...

    @abstractmethod
    def error(self, err: ApiError) -> tuple[int, dict]:
        """(HTTP status, error body)."""

    @abstractmethod
    def new_call_id(self) -> str: ...

    @abstractmethod
    def response(
        self, chat: ChatRequest, text: str, calls: list[tuple[str, ToolCall]], finish: str, usage: Usage
    ) -> dict:
        """The non-streamed answer; `calls` are (call id, call)."""

    @abstractmethod
    def stream(self, chat: ChatRequest, usage: Usage) -> BaseStream:
        """The stream of one answer; `usage` has its input (and cached) tokens, its output still 0."""

    @abstractmethod
    def stream_error(self, err: ApiError) -> list[Event]:
        """The events that end a stream failing after it began."""


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
        after = b"".join(b"," + jsonio.dumpb(k) + b":" + jsonio.dumpb(body[k]) for k in keys[keys.index(key) + 1 :])
    except TypeError:
        return -1
    tail = b"]" + after + b"}"
    return len(raw) - len(tail) if raw.endswith(tail) else -1


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


class OutputStream:
    """One streamed answer's events from its growing output ids (pure): text while it is safe to
    show (see `streamable_text`), then each tool call as its tokens arrive (name, then argument
    JSON chunks). The scanner that streamed the calls also parses the finished answer (`result`),
    as without streaming. A streamed call the parse rejects (the model broke its JSON after the
    arguments began, or hit max_tokens inside them) stays a tool call with the partial input sent;
    the non-streamed answer would show no call there.
    """

    def __init__(self, events: BaseStream, decode, new_call_id):
        self.events, self.new_call_id = events, new_call_id
        self.text, self.scanner = IncrementalText(decode), ToolCallScanner()
        self.shown, self.frozen = "", False
        self.ids: dict[int, str] = {}
        """Occurrence index -> id of a call streamed so far."""

    def update(self, output_ids: list[int]) -> list[Event]:
        full = self.text.update(output_ids)
        out = []
        if not self.frozen:
            safe = streamable_text(full)
            self.frozen = text_closed(full)
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

    def result(self, output_ids: list[int]) -> tuple[str, list[tuple[str, ToolCall]]]:
        """The answer's text and (id, call)s once all `output_ids` arrived, streamed calls keeping their ids."""
        parsed, indices = self.scanner.parse(self.text.update(output_ids))
        text = parsed.content if parsed.content.startswith(self.shown) else self.shown
        calls = []
        for k, c in zip(indices, parsed.tool_calls):
            cid = self.ids.get(k)
            if cid is not None and not self.scanner.streamed_as(k, c):
                log.warning("streamed tool call %s differs from its parse; sending it again whole", cid)
                cid = None
            calls.append((cid or self.new_call_id(), c))
        return text, calls

    def finish(self, text: str, calls: list[tuple[str, ToolCall]], finish: str, usage: Usage) -> list[Event]:
        """The rest of the text, the calls not streamed yet, and the wire's closing events."""
        return self.events.text(text[len(self.shown) :]) + self.events.finish(calls, finish, usage)
