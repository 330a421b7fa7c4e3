"""Token-faithful prompts: messages -> token ids that reuse the exact ids the model produced (pure).

A harness sends its whole conversation on every call, as text. Re-tokenizing the assistant turns
would drift from what the model actually emitted (another split of the same text, a tool call's
JSON re-serialised), so records would not form clean prefixes and training would score tokens the
policy never sampled. The proxy therefore remembers, per execution, the output ids of every
assistant turn it served, keyed by the turn as the harness sees it (its text and tool calls), and
renders a request message by message: a remembered assistant turn becomes

    generation prompt + the model's output ids (+ end-of-turn if it stopped on length) + separator

and every run of other messages between such turns is rendered by the chat template, as a run
(Qwen's template joins consecutive tool results into one turn) after a fixed anchor system message
that is then cut off (so a template injecting a default system prompt into a conversation without
one, as Qwen's does, renders the run without it). For the ChatML templates Gyre uses, rendering
piece by piece equals rendering the whole list (checked once per tokenizer by `Renderer.__init__`).
A template that is not separable (one that numbers turns, or renders earlier turns differently
from the last) is rendered whole, with no reuse: every assistant turn counts as retokenized.

Per call, only what the call adds is rendered and tokenized: a render leaves checkpoints (after the
head, after each remembered assistant turn, and after its last run), and the next call of the
same conversation, which shares the messages up to one (`RenderResult.resume_from`), starts there
with the earlier ids and their JSON (`PromptIds`, what the engine is sent) instead of rendering the
prefix again; its ids continue the earlier prompt's in place (`IdBuffer`), so not even they are
copied. The last run's checkpoint holds only if the run ends at the same message, that is, if the
next message is a remembered assistant turn (or there is none: a re-sent call).

The memory survives a proxy restart: the records are its durable copy, and the first call of an
execution a process has no memory of refills it from them (`remember_records`, called by
`gyre.proxy.executions.ProxyExecution.ready`).

When this cannot hold: the harness edited an assistant turn (trimmed text, changed a tool call,
dropped thinking), or the turn was served by another proxy over another records directory. Then
the key misses and the turn is re-rendered from its text: the prompt is still a correct rendering,
but the record diverges from the earlier call at that turn, so the trajectory processor starts a
new branch there instead of continuing the old one. `RenderResult.num_retokenized` counts such
turns (recorded in the record's hints).
"""

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from gyre.common import jsonio
from gyre.models.tokenizer import BaseTokenizer

log = logging.getLogger(__name__)


def assistant_key(content: str, tool_calls) -> str:
    """The identity of an assistant turn as a harness echoes it back: text and calls, not ids."""
    calls = [[c["name"], c.get("arguments", {})] for c in tool_calls or []]
    return jsonio.dumps([content.strip(), calls], sort_keys=True)


class TurnMemory:
    """The output ids of one execution's recent assistant turns, by `assistant_key` (LRU-bounded).

    Turns are found first among the asking agent's own, then among any agent's of the execution
    (a forked sub-agent echoes its parent's turns), so agents that happen to say the same text
    never swap each other's tokens.
    """

    def __init__(self, max_turns: int = 4096):
        self.max_turns = max_turns
        self._turns: OrderedDict[tuple[str, str], list[int]] = OrderedDict()

    def remember(self, key: str, output_ids: list[int], agent_id: str = "") -> None:
        for k in {(agent_id, key), ("", key)}:
            self._turns[k] = list(output_ids)
            self._turns.move_to_end(k)
        while len(self._turns) > self.max_turns:
            self._turns.popitem(last=False)

    def get(self, key: str, agent_id: str = "") -> list[int] | None:
        for k in ((agent_id, key), ("", key)):
            ids = self._turns.get(k)
            if ids is not None:
                self._turns.move_to_end(k)
                return ids
        return None


def remember_records(memory: TurnMemory, records, parse) -> None:
    """Refill `memory` from an execution's records in file order (the order turns were served).

    Args:
        parse: output ids -> ParsedAssistant (the tokenizer's `parse_assistant`), to key each turn
            as the harness will echo it back.
    """
    for r in records:
        out = r.output_ids.tolist()
        p = parse(out)
        memory.remember(
            assistant_key(p.content, [{"name": c.name, "arguments": c.arguments} for c in p.tool_calls]),
            out,
            r.agent_id,
        )


_ANCHOR = ({"role": "system", "content": "anchor"},)
"""The system message each message is rendered after (see Renderer)."""


@dataclass(frozen=True)
class RenderCheckpoint:
    """A point of a rendered prompt where the next call of the conversation may start."""

    num_messages: int
    """Messages rendered before this point (a prefix of the template's message list)."""
    num_ids: int
    num_json: int
    """Pieces of the prompt's JSON array up to here ("[" and the ids' pieces; see PromptIds)."""
    num_reused: int
    num_retokenized: int
    closed: bool
    """False for the point after the last run: valid only where the next message closes that run."""


class IdBuffer:
    """The int32 ids of a conversation's prompts, shared: each prompt's `input_ids` is a view of its
    prefix. Filled positions (below `size`) never change, so a prompt continuing an earlier one
    writes only what it adds (rewriting a few equal ids, the generation prompt, is allowed) instead
    of copying the whole context (4 MB at a million tokens); one that differs there copies its prefix
    into a buffer of its own."""

    def __init__(self, capacity: int = 1024):
        self.array = np.empty(capacity, np.int32)
        self.size = 0

    def put(self, at: int, ids: list[int]) -> "IdBuffer":
        """`ids` at position `at` (<= size); returns the buffer that holds them (this one or a copy)."""
        assert at <= self.size, (at, self.size)
        end, seen = at + len(ids), min(self.size, at + len(ids)) - at
        if seen and not np.array_equal(self.array[at : at + seen], ids[:seen]):
            own = IdBuffer(2 * end)
            own.array[:at] = self.array[:at]
            own.size = at
            return own.put(at, ids)
        if end > self.array.size:  # earlier prompts keep their views of the old array
            grown = np.empty(2 * end, np.int32)
            grown[: self.size] = self.array[: self.size]
            self.array = grown
        self.array[at + seen : end] = ids[seen:]
        self.size = max(self.size, end)
        return self


class PromptIds:
    """A prompt built from pieces: int32 ids (in an `IdBuffer`) and their JSON array (the /generate
    field) as a list of byte pieces, starting from an earlier prompt's prefix without encoding or
    copying it again (the pieces are joined once, into the request to the engine)."""

    def __init__(self, base: "RenderResult | None" = None, at: RenderCheckpoint | None = None):
        self.buffer = base.ids_buffer if base is not None else IdBuffer()
        self._json: list = list(base.input_json[: at.num_json]) if base is not None else [b"["]
        self.num_ids = at.num_ids if base is not None else 0

    @property
    def num_json(self) -> int:
        return len(self._json)

    def add(self, ids: list[int]) -> None:
        if not ids:
            return
        text = jsonio.dumpb(ids)[1:-1]
        self._json.append(b"," + text if self.num_ids else text)
        self.buffer = self.buffer.put(self.num_ids, ids)
        self.num_ids += len(ids)

    @staticmethod
    def of(ids: list[int]) -> tuple[np.ndarray, bytes]:
        p = PromptIds()
        p.add(ids)
        return p.finish()

    def finish(self) -> tuple[np.ndarray, tuple[bytes, ...]]:
        return self.buffer.array[: self.num_ids], (*self._json, b"]")


@dataclass(frozen=True, eq=False)
class RenderResult:
    input_ids: np.ndarray
    """int32 prompt ids."""
    input_json: tuple[bytes, ...]
    """`input_ids` as a compact JSON array in pieces (what /generate is sent; `b"".join` them)."""
    num_reused: int
    """Assistant turns whose ids came from memory."""
    num_retokenized: int
    """Assistant turns rendered from text (memory miss: edited history or another proxy)."""
    checkpoints: tuple[RenderCheckpoint, ...] = ()
    num_rendered_messages: int = 0
    """Messages this call rendered itself (the rest came from an earlier call's checkpoint)."""
    tools: list | None = field(default=None, repr=False)
    ids_buffer: IdBuffer | None = field(default=None, repr=False)
    """Where `input_ids` lives; a later prompt resuming from this one continues it."""

    def resume_from(
        self, messages: list[dict], num_shared: int, memory: "TurnMemory", agent_id: str
    ) -> RenderCheckpoint | None:
        """The last checkpoint within the first `num_shared` messages (equal to this render's) that
        holds for `messages`; None if there is none."""
        for c in reversed(self.checkpoints):
            if c.num_messages > num_shared:
                continue
            if c.closed or c.num_messages == len(messages):
                return c
            m = messages[c.num_messages]
            if (
                m["role"] == "assistant"
                and memory.get(assistant_key(m.get("content") or "", m.get("tool_calls")), agent_id) is not None
            ):
                return c
        return None


class Renderer:
    """Renders ChatRequest messages for one tokenizer, reusing remembered assistant ids.

    Where the template renders a lone message differently from the same message after a system
    turn (it injects a default system prompt into a conversation without one, as Qwen's does), runs
    are rendered after a fixed anchor system message that is then cut off (`anchored`); otherwise
    directly, which is cheaper.
    """

    def __init__(self, tokenizer: BaseTokenizer):
        self.tok = tokenizer
        self.stops = set(tokenizer.stop_token_ids)
        self.anchor_ids = tokenizer.apply_chat_template(list(_ANCHOR), None, False)
        self.gen_prompt = self._after_anchor(tokenizer.apply_chat_template(list(_ANCHOR), None, True)) or []
        sample = (
            self._after_anchor(
                tokenizer.apply_chat_template([*_ANCHOR, {"role": "assistant", "content": "x"}], None, False)
            )
            or []
        )
        stops = [i for i, t in enumerate(sample) if t in self.stops]
        probe = [{"role": "user", "content": "u"}, {"role": "tool", "content": "r"}]
        self.anchored = tokenizer.apply_chat_template(probe, None, False) != self._after_anchor(
            tokenizer.apply_chat_template([*_ANCHOR, *probe], None, False)
        )
        self.separable = bool(self.gen_prompt) and bool(stops)
        if self.separable:
            self.end_of_turn, self.separator = sample[stops[-1]], sample[stops[-1] + 1 :]
            self.separable = self._is_separable()
        if not self.separable:
            log.warning("chat template is not message-separable: prompts are re-rendered whole (no token reuse)")

    def _after_anchor(self, ids: list[int]) -> list[int] | None:
        n = len(self.anchor_ids)
        return ids[n:] if ids[:n] == self.anchor_ids else None

    def _run(self, run: list[dict]) -> list[int] | None:
        """The ids of a run of messages inside a conversation (None if the anchor does not split off)."""
        if not self.anchored:
            return self.tok.apply_chat_template(run, None, False)
        return self._after_anchor(self.tok.apply_chat_template([*_ANCHOR, *run], None, False))

    def _is_separable(self) -> bool:
        msgs = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a", "tool_calls": [{"name": "f", "arguments": {"x": 1}}]},
            {"role": "tool", "content": "r"},
            {"role": "tool", "content": "r2"},
        ]
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        probes = [(msgs, tools), (msgs[1:], tools), (msgs[1:], None)]
        pieces = [self._piecewise(m, t, TurnMemory(), "", None) for m, t in probes]
        return all(
            p is not None and p.input_ids.tolist() == self.tok.apply_chat_template(m, t, True)
            for p, (m, t) in zip(pieces, probes)
        )

    def _head(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[dict]] | None:
        """The ids before the first non-system message (the system turn, given or the template's
        default, with the tools), and the messages after it; None if the template does not split so."""
        apply = self.tok.apply_chat_template
        if messages[0]["role"] == "system":
            return apply(messages[:1], tools, False), messages[1:]
        first, alone = apply(messages[:1], tools, False), self._run(messages[:1])
        if alone is None or first[len(first) - len(alone) :] != alone:
            return None
        return first[: len(first) - len(alone)], messages

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        memory: TurnMemory,
        agent_id: str = "",
        resume: tuple[RenderResult, int] | None = None,
    ) -> RenderResult:
        """Prompt ids for `messages` (system first, if any) and `tools`, ending with the generation prompt.

        Args:
            resume: (an earlier render of this conversation with the same tools, how many leading
                messages it shares with `messages`): rendering starts at its last checkpoint that holds.

        Raises:
            ChatTemplateError: a message the template cannot render.
        """
        done = self._piecewise(messages, tools, memory, agent_id, resume) if self.separable else None
        if done is None:
            n = sum(m["role"] == "assistant" for m in messages)
            ids = PromptIds()
            ids.add(self.tok.apply_chat_template(messages, tools, True))
            return RenderResult(
                *ids.finish(), 0, n, num_rendered_messages=len(messages), tools=tools, ids_buffer=ids.buffer
            )
        return done

    def _start(self, messages, tools, memory, agent_id, resume) -> tuple[PromptIds, int, int, int, list, int] | None:
        """Where rendering starts: (prompt so far, first message to render, reused, retokenized,
        checkpoints so far, messages taken from `resume`); from `resume`'s checkpoint when one holds,
        else after the head."""
        if resume is not None and resume[0].tools == tools:
            base, shared = resume
            at = base.resume_from(messages, shared, memory, agent_id)
            if at is not None:
                kept = [c for c in base.checkpoints if c.num_messages <= at.num_messages and c.closed] + (
                    [] if at.closed else [at]
                )
                return PromptIds(base, at), at.num_messages, at.num_reused, at.num_retokenized, kept, at.num_messages
        head = self._head(messages, tools) if messages else None
        if head is None:
            return None
        ids = PromptIds()
        ids.add(head[0])
        first = len(messages) - len(head[1])
        return ids, first, 0, 0, [RenderCheckpoint(first, ids.num_ids, ids.num_json, 0, 0, True)], 0

    def _piecewise(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        memory: TurnMemory,
        agent_id: str,
        resume: tuple[RenderResult, int] | None,
    ) -> RenderResult | None:
        """Message-by-message rendering with remembered turns; None where the template does not split."""
        start = self._start(messages, tools, memory, agent_id, resume)
        if start is None:
            return None
        ids, first, reused, retokenized, checkpoints, num_kept = start
        run: list[dict] = []  # messages rendered by the template together (consecutive tool results may share a turn)
        for j in range(first, len(messages) + 1):
            m = messages[j] if j < len(messages) else None
            out = None
            if m is not None and m["role"] == "assistant":
                out = memory.get(assistant_key(m.get("content") or "", m.get("tool_calls")), agent_id)
                retokenized += out is None
            if m is not None and out is None:
                run.append(m)
                continue
            if run:
                alone = self._run(run)
                if alone is None:
                    return None
                ids.add(alone)
                run = []
                if m is None:  # the last run: the next call may start here if it closes the run alike
                    checkpoints.append(RenderCheckpoint(j, ids.num_ids, ids.num_json, reused, retokenized, False))
            if out is not None:
                ids.add(
                    self.gen_prompt
                    + out
                    + ([] if out and out[-1] in self.stops else [self.end_of_turn])
                    + self.separator
                )
                reused += 1
                checkpoints.append(RenderCheckpoint(j + 1, ids.num_ids, ids.num_json, reused, retokenized, True))
        ids.add(self.gen_prompt)
        return RenderResult(
            *ids.finish(), reused, retokenized, tuple(checkpoints), len(messages) - num_kept, tools, ids.buffer
        )
