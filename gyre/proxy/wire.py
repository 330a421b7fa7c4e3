"""The two wire formats as small hooks the call lifecycle (gyre.proxy.calls) fills in (pure).

Each hook object parses a body, reads the harness hints, names its tool-call ids, and turns the
proxy's result (text, tool calls, finish, token counts) into its API's response, stream events
(as (event name or None, JSON text) pairs) and error bodies.
"""

import json

from gyre.models.tokenizer import ToolCall
from gyre.proxy import anthropic, openai
from gyre.proxy.chat import ApiError, ChatRequest
from gyre.proxy.hints import CallHints, anthropic_hints, openai_hints

_MARKERS = ("<tool_call>", "<|im_end|>", "<|endoftext|>")


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


class AnthropicWire:
    name = "anthropic"

    def __init__(self, models: list[str], default_max_tokens: int):
        self.models = models

    def parse(self, body) -> ChatRequest:
        return anthropic.parse_request(body, self.models)

    def hints(self, headers, body: dict, chat: ChatRequest) -> CallHints:
        return anthropic_hints(headers, body, anthropic.summary_request(body), bool(chat.tools))

    def error(self, err: ApiError) -> tuple[int, dict]:
        return err.status, anthropic.make_error(err)

    def new_call_id(self) -> str:
        return anthropic.new_tool_id()

    def response(self, model, text, calls, finish, n_in, n_out) -> dict:
        return anthropic.make_response(anthropic.new_message_id(), model, text, calls, finish, anthropic.make_usage(n_in, n_out))

    def stream(self, model: str, chat: ChatRequest, n_in: int) -> "AnthropicStream":
        return AnthropicStream(anthropic.StreamEvents(anthropic.new_message_id(), model, n_in))

    def stream_error(self, err: ApiError) -> list[tuple[str | None, str]]:
        return [("error", json.dumps(anthropic.make_error(err)))]


class AnthropicStream:
    def __init__(self, events: anthropic.StreamEvents):
        self.ev = events

    def start(self):
        return [(n, json.dumps(d)) for n, d in self.ev.start()]

    def text(self, delta: str):
        return [(n, json.dumps(d)) for n, d in self.ev.text(delta)]

    def finish(self, calls: list[tuple[str, ToolCall]], finish: str, n_in: int, n_out: int):
        return [(n, json.dumps(d)) for n, d in self.ev.finish(calls, finish, n_out)]


class OpenAIWire:
    name = "openai"

    def __init__(self, models: list[str], default_max_tokens: int):
        self.models, self.default_max_tokens = models, default_max_tokens

    def parse(self, body) -> ChatRequest:
        return openai.parse_request(body, self.models, self.default_max_tokens)

    def hints(self, headers, body: dict, chat: ChatRequest) -> CallHints:
        return openai_hints(headers, body)

    def error(self, err: ApiError) -> tuple[int, dict]:
        return openai.error_status(err), openai.make_error(err)

    def new_call_id(self) -> str:
        return openai.new_call_id()

    def response(self, model, text, calls, finish, n_in, n_out) -> dict:
        return openai.make_response(openai.new_completion_id(), model, text, calls, finish, openai.make_usage(n_in, n_out))

    def stream(self, model: str, chat: ChatRequest, n_in: int) -> "OpenAIStream":
        return OpenAIStream(openai.StreamChunks(openai.new_completion_id(), model, chat.include_usage))

    def stream_error(self, err: ApiError) -> list[tuple[str | None, str]]:
        return [(None, json.dumps(openai.make_error(err))), (None, "[DONE]")]


class OpenAIStream:
    def __init__(self, chunks: openai.StreamChunks):
        self.ch = chunks

    def start(self):
        return [(None, json.dumps(c)) for c in self.ch.start()]

    def text(self, delta: str):
        return [(None, json.dumps(c)) for c in self.ch.text(delta)]

    def finish(self, calls, finish: str, n_in: int, n_out: int):
        chunks = self.ch.finish(calls, finish, openai.make_usage(n_in, n_out))
        return [(None, json.dumps(c)) for c in chunks] + [(None, "[DONE]")]
