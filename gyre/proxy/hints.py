"""Harness hints (pure): which agent of the execution made a call and what kind of call it is.

Claude Code: sub-agents send the header `x-claude-code-agent-id` and `cc_is_subagent=true` in the
first system block, and a sub-agent spawned by another sub-agent also sends its spawner's id in
`x-claude-code-parent-agent-id` (ids percent-encoded; a sub-agent without it was spawned by the
main agent); a compaction summary is a request whose last user message asks for a summary
and not to call tools; the session id comes in `X-Claude-Code-Session-Id`. Calls without tools
from the main agent (titles, quota probes) are auxiliary. OpenAI-style harnesses may name their
agent with `x-gyre-agent-id` / `x-gyre-parent-agent-id`; everything else they send that is not a
credential is kept in `hints` as it came.
"""

from dataclasses import dataclass
from urllib.parse import unquote

from gyre.records.record import MAIN_AGENT

_SECRET_HEADERS = {"authorization", "x-api-key", "x-gyre-key", "cookie"}
_KEPT_PREFIXES = ("x-claude-code-", "x-gyre-", "x-stainless-retry", "user-agent", "anthropic-beta", "x-app")


@dataclass(frozen=True)
class CallHints:
    agent_id: str
    parent_agent_id: str | None
    kind_hint: str
    raw: dict


def _kept_headers(headers: dict[str, str]) -> dict[str, str]:
    return {
        k.lower(): v
        for k, v in headers.items()
        if k.lower() not in _SECRET_HEADERS and k.lower().startswith(_KEPT_PREFIXES)
    }


def _first_system_text(body: dict) -> str:
    system = body.get("system")
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return " ".join(str(b.get("text", "")) for b in system[:3] if isinstance(b, dict))
    return ""


def _header(headers, name: str) -> str | None:
    """A header's value by case-insensitive name (aiohttp's headers are; plain dicts in tests are not)."""
    value = headers.get(name)
    if value is None:
        value = next((v for k, v in headers.items() if k.lower() == name), None)
    return unquote(value) if value else None


def anthropic_hints(headers: dict[str, str], body: dict, is_summary: bool, has_tools: bool) -> CallHints:
    """Hints of a /v1/messages call (Claude Code's signs, see module doc)."""
    raw = _kept_headers(headers)
    agent = _header(headers, "x-claude-code-agent-id")
    parent = _header(headers, "x-claude-code-parent-agent-id")
    marker = "cc_is_subagent=true" in _first_system_text(body)
    raw["cc_is_subagent"] = marker
    raw["summary_request"] = is_summary
    meta = body.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("user_id"), str):
        raw["metadata_user_id"] = meta["user_id"][:500]
    if agent or marker:
        agent_id = agent or "subagent"
        parent = parent if parent and parent != agent_id else MAIN_AGENT
        return CallHints(agent_id, parent, "subagent_summary" if is_summary else "subagent", raw)
    kind = "summary" if is_summary else ("main" if has_tools else "auxiliary")
    return CallHints(MAIN_AGENT, None, kind, raw)


def openai_hints(headers: dict[str, str], body: dict) -> CallHints:
    """Hints of a /v1/chat/completions call: an explicit agent header, else the main agent;
    `x-gyre-call-kind: summary` marks a compaction summary (chat completions have no other sign)."""
    raw = _kept_headers(headers)
    if isinstance(body.get("user"), str):
        raw["user"] = body["user"][:500]
    agent = _header(headers, "x-gyre-agent-id")
    if agent and agent != MAIN_AGENT:
        parent = _header(headers, "x-gyre-parent-agent-id")
        return CallHints(agent, parent if parent and parent != agent else MAIN_AGENT, "subagent", raw)
    if _header(headers, "x-gyre-call-kind") == "summary":
        return CallHints(MAIN_AGENT, None, "summary", raw)
    return CallHints(MAIN_AGENT, None, "main" if body.get("tools") else "unknown", raw)
