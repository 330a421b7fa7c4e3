"""Parsing an assistant turn's output text in the chat format (pure): its thinking block, its text
and its `<tool_call>` JSON calls, whole or while the text grows.

One scanner decides what is a call, for streamed and whole answers alike: `ToolCallScanner` finds
each `<tool_call>` as it arrives (its name, then the raw text of its arguments, for streaming) and
`ToolCallScanner.parse` turns the finished text into the turn; `parse_assistant_text` is that parse
of a whole text. Rules: nothing after the first `<|im_end|>` is part of the turn; everything before
the first `</think>` is the thinking block (Qwen3: the template may open it in the prompt); a call
is the JSON object between `<tool_call>` and the next `</tool_call>` with a string `name` and an
object (or JSON-string) `arguments`; a closed body that is not one is kept as malformed.
"""

import re
from dataclasses import dataclass, field

from gyre.common import jsonio

_MARKERS = ("<tool_call>", "<|im_end|>", "<|endoftext|>")
_OPEN, _CLOSE, _END, _THINK_END = "<tool_call>", "</tool_call>", "<|im_end|>", "</think>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ParsedAssistant:
    """An assistant turn split into text and tool calls; `malformed` keeps unparseable call bodies."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    reasoning: str = ""
    """The turn's leading thinking block, without its tags (Qwen3 `<think>`); "" if none."""


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


def text_closed(text: str) -> bool:
    """Whether the turn's text is over: a tool call or the end marker began."""
    return _OPEN in text or _END in text


_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')
"""The start of a tool call as the template asks for it: name first, then an arguments object."""
_ARGS_KEY = re.compile(r'"arguments"\s*:\s*\S')


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
    then the raw text of the arguments object chunk by chunk; calls in another form are found by
    `parse` alone. Each character is scanned once. `stream=False` only finds the calls' bodies
    (a whole text's parse, which streams nothing)."""

    def __init__(self, stream: bool = True):
        self.stream = stream
        self.occurrences: list[_Occurrence] = []
        self.first = 0
        """Index of the first occurrence after the thinking block (the ones before are not calls)."""
        self.pos = 0
        """Where the next `<tool_call>` (or the open call's `</tool_call>`) may start."""
        self.open: _Occurrence | None = None
        self.end, self.end_from = -1, 0
        """Position of `<|im_end|>` once seen: nothing after it is part of the answer."""
        self.think_end, self.think_from = -1, 0
        """Position after the first `</think>` once seen: the answer starts there."""

    def _limit(self, text: str) -> int:
        if self.end < 0:
            self.end = text.find(_END, self.end_from)
            self.end_from = max(0, len(text) - len(_END) + 1)
        return self.end if self.end >= 0 else len(text.rstrip("\ufffd"))

    def _find(self, text: str, marker: str, limit: int) -> int:
        """`marker` at or after self.pos and before `limit`; remembers how far it looked."""
        i = text.find(marker, self.pos, limit)
        if i < 0:
            self.pos = max(self.pos, limit - len(marker) + 1)
        return i

    def _think(self, text: str, limit: int) -> None:
        """Start the answer after the first `</think>`: the occurrences before it were thinking."""
        i = text.find(_THINK_END, self.think_from, limit)
        if i < 0:
            self.think_from = max(self.think_from, limit - len(_THINK_END) + 1)
            return
        self.think_end = self.pos = i + len(_THINK_END)
        self.first, self.open = len(self.occurrences), None

    def update(self, text: str) -> list[tuple[str, int, str]]:
        """Events since the last update: ("start", k, name) and ("args", k, json chunk), k = occurrence index."""
        limit = self._limit(text)
        if self.think_end < 0:
            self._think(text, limit)
        events: list[tuple[str, int, str]] = []
        while True:
            if self.open is None:
                i = self._find(text, _OPEN, limit)
                if i < 0:
                    return events
                self.open = _Occurrence(i + len(_OPEN))
                self.occurrences.append(self.open)
                self.pos = self.open.body_start
            oc, k = self.open, len(self.occurrences) - 1
            close = self._find(text, _CLOSE, limit)
            if self.stream:
                self._advance(text, oc, k, close if close >= 0 else limit, close >= 0, events)
            if close < 0:
                return events
            oc.body = text[oc.body_start : close]
            self.pos, self.open = close + len(_CLOSE), None

    def _advance(self, text: str, oc: _Occurrence, k: int, avail: int, closed: bool, events: list) -> None:
        """Stream occurrence k's name and arguments up to `avail`."""
        if oc.name is None and oc.args_start < 0:
            self._head(text, oc, avail, closed, k, events)
        if oc.name is not None and oc.args_end < 0:
            self._scan(text, oc, avail)
            upto = oc.args_end if oc.args_end >= 0 else avail
            if upto > oc.sent:
                events.append(("args", k, text[oc.sent : upto]))
                oc.arguments += text[oc.sent : upto]
                oc.sent = upto

    @staticmethod
    def _head(text: str, oc: _Occurrence, avail: int, closed: bool, k: int, events: list) -> None:
        m = _CALL_HEAD.match(text, oc.body_start, avail)
        if m is None:
            if closed or not _could_be_head(text[oc.body_start : avail]):
                oc.args_start = avail  # another form: left to the final parse
            return
        try:
            oc.name = jsonio.loads('"' + m.group(1) + '"')
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

    def parse(self, text: str) -> tuple[ParsedAssistant, list[int]]:
        """The turn once all of `text` (the text updates grew to) has arrived.

        Returns:
            (the turn, the occurrence index of each of its tool calls)
        """
        self.update(text)
        start, end = max(self.think_end, 0), self.end if self.end >= 0 else len(text)
        reasoning = ""
        if self.think_end >= 0:
            head = text[: self.think_end - len(_THINK_END)].lstrip()
            reasoning = head.removeprefix("<think>").strip("\n")
        calls, indices, malformed, pieces = [], [], [], []
        for k in range(self.first, len(self.occurrences)):
            oc = self.occurrences[k]
            if oc.body is None:  # not closed: stays in the text
                continue
            pieces.append(text[start : oc.body_start - len(_OPEN)])
            start = oc.body_start + len(oc.body) + len(_CLOSE)
            call = _parse_call(oc.body.strip())
            if call is None:
                malformed.append(oc.body.strip())
            else:
                calls.append(call)
                indices.append(k)
        pieces.append(text[start:end])
        return ParsedAssistant("".join(pieces).strip(), calls, malformed, reasoning), indices

    def streamed_as(self, k: int, call: ToolCall) -> bool:
        """Whether occurrence k was streamed whole and as `call` (its name and arguments)."""
        oc = self.occurrences[k]
        if oc.name != call.name or oc.args_end < 0:
            return False
        try:
            return jsonio.loads(oc.arguments) == call.arguments
        except ValueError:
            return False


def _could_be_head(prefix: str) -> bool:
    """Whether a body prefix that does not match `_CALL_HEAD` yet still may (its arguments value
    has not begun, and it is not absurdly long for a name)."""
    return len(prefix) < 4096 and _ARGS_KEY.search(prefix) is None


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = jsonio.loads(body)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", {})
        args = jsonio.loads(args) if isinstance(args, str) else args
    except ValueError:
        return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


def parse_assistant_text(text: str) -> ParsedAssistant:
    """Split generated assistant text (special tokens kept) into thinking, content and calls."""
    return ToolCallScanner(stream=False).parse(text)[0]
