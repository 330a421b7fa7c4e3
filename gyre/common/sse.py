"""Server-sent events, framed in one place: the proxy's streamed answers, the builtin engine's and
the SGLang fake's. SGLang's framing (0.5.21 `srt/entrypoints/http_server.py`): each event a
`data: <one line of JSON>` line and a blank line, literal `data: [DONE]` last."""

from collections.abc import Iterable
from typing import Any

from aiohttp import web
from aiohttp_sse import EventSourceResponse, sse_response

from gyre.common.jsonio import dumps

SseEvent = tuple[str | None, Any]
"""One event: (event name or None, data: a JSON value, or literal text such as `[DONE]`)."""


def open_stream(request: web.Request):
    """The event stream answering `request` (an async context manager: use as `async with`)."""
    return sse_response(request, sep="\n", allow_all_methods=True)


async def send_events(stream: EventSourceResponse, events: Iterable[SseEvent]) -> None:
    """Send each event, its JSON data as one line (literal text as it is)."""
    for name, data in events:
        await stream.send(data if isinstance(data, str) else dumps(data), event=name)
