"""The lifecycle of one model call, shared by all APIs (each implements gyre.proxy.wire.BaseWire).

    body ─parse─> ChatRequest ─render (token-faithful)─> input ids ─Generation (routes, reroutes)─>
    output ids ─parse─> text + tool calls ─wire─> response / SSE events
                                         └────> CallRecord ─> the execution's records file

A call is numbered (seq, started_at) when it first gets an engine, so refusals (bad input,
unknown model, too long, overloaded) leave no gaps; a call that fails after its engine produced
output is recorded with it (finish abort, the error in its hints), one that fails before leaves a
seq gap that the trajectory processor reports.
"""

import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from gyre.common import jsonio
from gyre.common.sse import open_stream, send_events
from gyre.metrics.events import ModelCall
from gyre.metrics.log import EventLog
from gyre.models.tokenizer import BaseTokenizer, ChatTemplateError
from gyre.proxy.chat import ApiError, ChatRequest, Resume, invalid
from gyre.proxy.config import ProxyConfig
from gyre.proxy.conversation import RequestSnapshot
from gyre.proxy.executions import ProxyExecution
from gyre.proxy.generation import Generation
from gyre.proxy.hints import CallHints
from gyre.proxy.pool import EnginePool
from gyre.proxy.render import Renderer, RenderResult, assistant_key
from gyre.proxy.wire import BaseWire, OutputStream, Usage
from gyre.records.record import CallRecord


@dataclass
class Call:
    """One call in flight: what was asked, how it was rendered, and its generation."""

    ex: ProxyExecution
    chat: ChatRequest
    hints: CallHints
    rendered: RenderResult
    gen: Generation
    is_retry: bool
    api: str
    seq: int = -1
    started_at: float = 0.0
    received_at: float = field(default_factory=time.time)
    """When the request arrived (started_at is when it got an engine; the gap is queueing)."""
    received_mono: float = field(default_factory=time.monotonic)
    """The handler's start, for `proxy_ms`: the call's time outside engine calls until its record."""

    def admit(self) -> None:
        """Number the call when it gets its first engine: refused calls (overloaded) leave no gap."""
        self.seq, self.started_at = self.ex.begin_call()


class CallRunner:
    def __init__(
        self,
        cfg: ProxyConfig,
        tokenizer: BaseTokenizer,
        renderer: Renderer,
        pool: EnginePool,
        events: EventLog | None = None,
    ):
        self.cfg, self.tok, self.renderer, self.pool, self.events = cfg, tokenizer, renderer, pool, events
        self.stop_token_ids = tokenizer.stop_token_ids
        """Asked once: an HF tokenizer looks them up by name."""

    def render(
        self, ex: ProxyExecution, wire: BaseWire, body, headers, keep: bool = True, raw: bytes = b""
    ) -> tuple[ChatRequest, CallHints, RenderResult, bool]:
        """Parse and render only what the call adds to its conversation's snapshot (see
        gyre.proxy.conversation); `keep` stores the call as the conversation's new snapshot; `raw`
        (the body's bytes) lets the next call find what it shares by comparing bytes.

        Returns:
            (request, hints, rendered prompt, whether the call re-sends an earlier one)
        Raises:
            ApiError: invalid_request (naming the field) or not_found.
        """
        request = wire.split(body, raw)
        snap, num = ex.conversations.match(request) if request is not None else (None, 0)
        chat = wire.parse(body, Resume(snap.chat.messages, snap.chat.marks, num) if num else None)
        hints = wire.hints(headers, body, chat)
        try:
            rendered = self.renderer.render(
                chat.messages,
                chat.tools,
                ex.turns,
                hints.agent_id,
                (snap.rendered, chat.marks[num][0]) if num else None,
            )
        except ChatTemplateError as e:
            raise invalid(f"messages: {e}") from None
        is_retry = ex.conversations.is_retry(snap, num, request) or ex.repeats_restored(
            hints.agent_id, rendered.input_ids
        )
        if keep and request is not None:
            ex.conversations.store(
                RequestSnapshot(request, chat, rendered),
                snap if snap is not None and num == len(snap.request.messages) else None,
            )
        return chat, hints, rendered, is_retry

    def prepare(
        self, ex: ProxyExecution, wire: BaseWire, body: dict, headers, received_mono: float, raw: bytes = b""
    ) -> Call:
        """Validate and render; raises ApiError before anything is numbered or recorded.

        Args:
            received_mono: time.monotonic() when the handler started (for the proxy_ms hint).
            raw: the body's bytes (see `render`).
        """
        chat, hints, rendered, is_retry = self.render(ex, wire, body, headers, raw=raw)
        n = rendered.input_ids.size
        if n >= self.cfg.context_len:
            raise invalid(f"prompt is too long: {n} tokens > {self.cfg.context_len - 1} maximum")
        sampling = {
            "max_new_tokens": min(chat.max_tokens, self.cfg.context_len - n),
            "stop_token_ids": self.stop_token_ids,
            "temperature": self.cfg.temperature
            if self.cfg.temperature is not None
            else (chat.temperature if chat.temperature is not None else 1.0),
        }
        if chat.top_p is not None:
            sampling["top_p"] = chat.top_p
        if chat.top_k is not None:
            sampling["top_k"] = chat.top_k
        gen = Generation(
            self.pool,
            f"{ex.execution_id}/{hints.agent_id}",
            f"{ex.execution_id}-{uuid.uuid4().hex[:12]}",
            rendered.input_ids,
            rendered.input_json,
            sampling,
            max_resumes=self.cfg.max_resumes,
            incremental=chat.stream,
        )
        call = Call(ex, chat, hints, rendered, gen, is_retry, wire.name, received_mono=received_mono)
        gen.on_admit = call.admit
        return call

    def _remember(self, call: Call, text: str, calls: list) -> None:
        """Remember the turn as the harness will echo it back, for token-faithful reuse."""
        key = assistant_key(text, [{"name": c.name, "arguments": c.arguments} for _, c in calls])
        call.ex.turns.remember(key, call.gen.output_ids, call.hints.agent_id)

    def make_record(self, call: Call, error: ApiError | None = None) -> CallRecord:
        """The call's record; `error`: why it failed after its output began (kept in its hints)."""
        g = call.gen
        hints = {
            **call.hints.raw,
            "api": call.api,
            "engines": g.engine_ids,
            "cached_tokens": g.cached_tokens,
            "received_at": call.received_at,
            "reused_turns": call.rendered.num_reused,
            "proxy_ms": round((time.monotonic() - call.received_mono - g.engine_s) * 1e3, 3),
            "engine_ms": round(g.engine_s * 1e3, 3),
            "retokenized_turns": call.rendered.num_retokenized,
            "rendered_messages": call.rendered.num_rendered_messages,
        }
        if error is not None:
            hints["error"] = {"kind": error.kind, "message": error.message}
        return CallRecord.build(
            input_ids=call.rendered.input_ids,
            output_ids=g.output_ids,
            logprobs=g.logprobs,
            versions=g.versions,
            execution_id=call.ex.execution_id,
            call_id=f"c{call.seq}",
            seq=call.seq,
            agent_id=call.hints.agent_id,
            parent_agent_id=call.hints.parent_agent_id,
            kind_hint=call.hints.kind_hint,
            finish_reason=g.finish,
            engine_id=g.engine_ids[-1] if g.engine_ids else "",
            cell_id=self.pool.cell_of(g.engine_ids[-1]) if g.engine_ids else "",
            rerouted=g.rerouted,
            num_migrated_tokens=g.num_migrated,
            num_recomputed_tokens=g.num_recomputed,
            started_at=call.started_at,
            finished_at=time.time(),
            is_retry=call.is_retry,
            hints=hints,
        )

    async def _record(self, call: Call, error: ApiError | None = None) -> None:
        """Append the call's record (before the answer completes) and its ModelCall event."""
        record = self.make_record(call, error)
        await call.ex.append(record)
        if self.events is not None:
            self.events.emit(
                ModelCall(
                    execution_id=record.execution_id,
                    agent_id=record.agent_id,
                    cell=int(record.cell_id) if record.cell_id.isdigit() else None,
                    engine_id=record.engine_id,
                    prompt_tokens=int(record.input_ids.size),
                    output_tokens=int(record.output_ids.size),
                    cached_tokens=int(call.gen.cached_tokens),
                    latency_s=record.finished_at - call.received_at,
                )
            )

    async def respond(self, request: web.Request, call: Call, wire: BaseWire) -> web.StreamResponse:
        """Run the generation and answer (JSON or SSE). The record is written before the answer
        completes (fsynced per `fsync_window_ms`), so whoever sees a harness finish can read all of
        its records."""
        self.pool.count_call()
        call.ex.num_inflight += 1
        try:
            return await self._respond(request, call, wire)
        finally:
            call.ex.num_inflight -= 1

    async def _respond(self, request: web.Request, call: Call, wire: BaseWire) -> web.StreamResponse:
        stream = call.gen.stream()
        try:
            first = await stream.__anext__()  # errors before any byte is sent are plain HTTP errors
        except StopAsyncIteration:
            first = []
        except ApiError as e:
            await self._record_failed(call, e)
            raise
        if call.chat.stream:
            return await self._stream(request, call, wire, stream, first)
        try:
            async for _ in stream:
                pass
        except ApiError as e:
            await self._record_failed(call, e)
            raise
        parsed = self.tok.parse_assistant(call.gen.output_ids)
        text, calls = parsed.content, [(wire.new_call_id(), c) for c in parsed.tool_calls]
        self._remember(call, text, calls)
        await self._record(call)
        answer = wire.response(call.chat, text, calls, call.gen.finish, _usage(call))
        return web.json_response(answer, dumps=jsonio.dumps)

    async def _record_failed(self, call: Call, error: ApiError) -> None:
        """A call that fails (the harness gets `error`) after its engine produced output keeps it: its
        record holds that output, finish abort, and the error in its hints, so the execution loses
        no call (a gap would exclude it); one that produced nothing leaves its seq gap."""
        if call.seq >= 0 and call.gen.output_ids:
            await self._record(call, error)

    async def _stream(self, request, call: Call, wire: BaseWire, stream, first: list[int]) -> web.StreamResponse:
        """SSE answer; a call failing after the stream began ends with its record and one error event."""
        events = wire.stream(call.chat, _usage(call))  # the first chunk has arrived: cached tokens known
        out = OutputStream(events, self.tok.decode, wire.new_call_id)
        async with open_stream(request) as sse:
            await send_events(sse, events.start())
            new = first
            try:
                while True:
                    if new:
                        await send_events(sse, out.update(call.gen.output_ids))
                    new = await stream.__anext__()
            except StopAsyncIteration:
                pass
            except ApiError as e:
                await self._record_failed(call, e)
                await send_events(sse, wire.stream_error(e))
                return sse
            text, calls = out.result(call.gen.output_ids)
            self._remember(call, text, calls)
            await self._record(call)
            await send_events(sse, out.finish(text, calls, call.gen.finish, _usage(call)))
            await sse.write_eof()
        return sse


def _usage(call: Call) -> Usage:
    """What the engine reported so far: the prompt, the output and the prompt tokens its cache served."""
    return Usage(int(call.rendered.input_ids.size), len(call.gen.output_ids), int(call.gen.cached_tokens))
