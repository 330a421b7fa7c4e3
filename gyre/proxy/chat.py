"""The proxy's own view of one chat request, shared by the Anthropic and OpenAI front ends (pure).

Both wire formats are parsed into a `ChatRequest` whose messages are the chat template's dicts
(`{"role", "content", "tool_calls": [{"id", "name", "arguments"}]}`), so rendering, routing and
recording never depend on the API. Errors are `ApiError`s with a kind each API maps to its own
error body and status.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from gyre.errors import GyreError

ERROR_KINDS = {
    "invalid_request": 400,
    "authentication": 401,
    "permission": 403,
    "not_found": 404,
    "too_large": 413,
    "overloaded": 529,
    "api_error": 500,
}


class ApiError(GyreError):
    """An answer to the harness other than a completion: `kind` picks the status and error type."""

    def __init__(self, kind: str, message: str):
        assert kind in ERROR_KINDS, kind
        self.kind, self.message = kind, message
        super().__init__(message)

    @property
    def status(self) -> int:
        return ERROR_KINDS[self.kind]


def invalid(message: str) -> ApiError:
    return ApiError("invalid_request", message)


@dataclass(frozen=True)
class ChatRequest:
    """What the model is asked, in the template's terms, plus sampling and delivery options."""

    model: str
    messages: list[dict]
    tools: list[dict] | None
    """Template tool specs: {"type": "function", "function": {"name", "description", "parameters"}}."""
    max_tokens: int
    stream: bool
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    include_usage: bool = False
    """OpenAI `stream_options.include_usage`: a last chunk with usage."""
    marks: list = field(default_factory=list, compare=False, repr=False)
    """Conversion marks of the wire's message list (see `convert_messages`), for the next call to resume."""


@dataclass(frozen=True)
class Resume:
    """Where the previous call of a conversation left its conversion: its converted messages and
    marks, and how many of the wire's raw messages this call shares with it (same head too)."""

    messages: list[dict]
    marks: list
    num_raw: int


def convert_messages(
    raw: list, step: Callable, state, head: list[dict], resume: Resume | None
) -> tuple[list[dict], list]:
    """Convert a wire's message list with `step(i, message, out, state) -> state` (appending to
    `out`), resuming after the `resume.num_raw` messages a previous call converted alike.

    Returns:
        (converted messages, marks): marks[i] = (len(out), state) before raw message i, plus one
        after the last, so a later call sharing raw[:k] starts at marks[k]. States are immutable.
    """
    k = resume.num_raw if resume is not None and 0 < resume.num_raw < len(resume.marks) else 0
    if k:
        n, state = resume.marks[k]
        out, marks = resume.messages[:n], resume.marks[:k]
    else:
        out, marks = list(head), []
    for i in range(k, len(raw)):
        marks.append((len(out), state))
        state = step(i, raw[i], out, state)
    marks.append((len(out), state))
    return out, marks


def require_type(value, types, where: str, what: str):
    """`value` if it has one of `types`, else an invalid-request error naming `where`."""
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise invalid(f"{where}: expected {what}, got a boolean")
    if not isinstance(value, types):
        raise invalid(f"{where}: expected {what}, got {type(value).__name__}")
    return value


def require_model(body, models: list[str]) -> str:
    """The requested model of a JSON-object body; not_found (listing the served ones) if it is not served."""
    require_type(body, dict, "body", "a JSON object")
    model = require_type(body.get("model"), str, "model", "a string")
    if model not in models:
        raise ApiError("not_found", f"The model {model!r} does not exist; available: {', '.join(models)}")
    return model


def check_tool_schema(schema, where: str) -> dict:
    """A tool's parameter schema must be a JSON-schema object (`type: object`)."""
    if not isinstance(schema, dict):
        raise invalid(f"{where}: the tool's schema must be a JSON object, got {type(schema).__name__}")
    if schema.get("type", "object") != "object":
        raise invalid(f"{where}: the tool's schema must have type 'object', got {schema.get('type')!r}")
    return schema


def check_sampling(body: dict, *, max_tokens_key: str, default_max_tokens: int | None) -> dict:
    """Validated sampling fields common to both APIs."""
    out = {}
    mt = body.get(max_tokens_key, default_max_tokens)
    if mt is None:
        raise invalid(f"{max_tokens_key}: Field required")
    require_type(mt, int, max_tokens_key, "an integer")
    if mt < 1:
        raise invalid(f"{max_tokens_key}: must be >= 1, got {mt}")
    out["max_tokens"] = mt
    for key, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        v = body.get(key)
        if v is not None:
            require_type(v, (int, float), key, "a number")
            if not lo <= v <= hi:
                raise invalid(f"{key}: must be in [{lo}, {hi}], got {v}")
            out[key] = float(v)
    if body.get("top_k") is not None:
        out["top_k"] = require_type(body["top_k"], int, "top_k", "an integer")
    return out
