"""The toy agent: a real multi-turn coding agent, in its own process, for the embedded default.

It talks to the proxy the way a user's agent would, over the Messages API or chat completions, with
`requests` and the official SDKs' retry policy (ApiClient) rather than the SDKs themselves: importing
one costs a start 0.7-1.9 CPU-s on the box's spare cores, outside the cells' CPU caps, where a real
harness's start-up is small beside its model's calls (tools/bench/harness_start.py measures it).
It calls tools in its workspace (write_file, read_file, run),
spawns a sub-agent that surveys the workspace (and, once the main agent is done, another with the
same prompt that lists it again: the path cap drops the first one's path, and the second's trains
the same prompt, so no call of the policy goes untrained), clears old tool results once the conversation
grows past `--clear-chars` (as Claude Code's micro-compaction does: the next call then branches
off the first one that saw them), and compacts its context with a summary request once it grows
past `--compact-chars`. Each tool call lasts a duration drawn from a
seeded log-normal (median, sigma, cap), so executions have the long tail the scheduler exists for.

    survey sub-agent (run / read_file, reports in one line)
        │ instruction + report
    main agent
        ├─ turn: model call ─> tool calls ─> tool results (sleep to the drawn duration) ─> ...
        ├─ conversation > clear_chars: every tool result but the latest turn's becomes CLEARED
        ├─ conversation > compact_chars: summary request ─> fresh conversation with the summary
        └─ a turn without tool calls (or max turns) ends it
    verify sub-agent (the survey's prompt; its report is logged)

Agents are told apart the way the proxy's hints read them (gyre/proxy/hints.py): on the
Messages API with Claude Code's `x-claude-code-agent-id` / `-parent-agent-id` headers, and a
summary request's last user message asks for a summary and not to call tools; on chat completions
with `x-gyre-agent-id` / `x-gyre-parent-agent-id`; there a summary request also sends
`x-gyre-call-kind: summary`, which the proxy records as kind `summary`. The pure functions
(`make_*`) are shared with the warm start, which renders reference transcripts exactly as this
agent's calls reach the proxy.
"""

import argparse
import hashlib
import math
import os
import random
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from gyre.common import jsonio
from gyre.common.files import write_atomic

APIS = ("anthropic", "openai")
MAIN_SYSTEM = "You are a coding agent. Use the tools to complete the task in the current directory."
SUB_SYSTEM = "You are a helper agent. Look at the workspace and report what you find in one line."
SUB_TASK = "List the files in the workspace."
SUMMARY_REQUEST = "Write a short summary of the conversation so far. Do NOT call any tools."
CLEARED = "[Old tool result content cleared]"
SESSION_FILE = "toy-session.json"
"""The agent's session in its HOME (the sandbox's home survives the job): a continued execution reloads it."""
CLEAR_CHARS = 100
"""Default `--clear-chars`: the reference run clears its write's result before its last call."""
TOOLS = [
    {
        "name": "write_file",
        "description": "Write text to a file.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    },
    {
        "name": "read_file",
        "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
    {
        "name": "run",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
]
RESULT_CHARS = 200
"""Tool results and reports are cut to this many characters (short prompts for the tiny model)."""
MAX_RETRIES = 2
"""Retries of a failed call, as the official SDKs' default `max_retries`."""
RETRY_STATUSES = (408, 409, 429, *range(500, 600))
"""Statuses the official SDKs retry (openai-python and anthropic-sdk-python `_base_client.py`
`_should_retry`): a timeout, a lock conflict, a rate limit, a server error or overload (503, 529)."""
TIMEOUT_S = 600
"""Seconds a call may take (connect, then between bytes of the answer), the SDKs' default."""
ANTHROPIC_VERSION = "2023-06-01"
"""The Messages API version header the anthropic SDK sends."""


@dataclass(frozen=True)
class ToolTime:
    """Log-normal tool-call durations: median_s * exp(sigma * N(0,1)), capped at max_s."""

    median_s: float = 0.05
    sigma: float = 2.5
    max_s: float = 60.0

    def draw(self, rng: random.Random) -> float:
        return min(self.max_s, self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))) if self.median_s > 0 else 0.0


def make_main_prompt(instruction: str, report: str) -> str:
    return f"{instruction}\nFiles: {report[:RESULT_CHARS]}" if report else instruction


def make_resumed_prompt(instruction: str, summary: str) -> str:
    return f"{instruction}\nSummary so far: {summary[:RESULT_CHARS]}"


def conversation_chars(messages: list[dict]) -> int:
    """Size of a conversation beyond its system prompt: what compaction bounds."""
    return sum(
        len(m.get("content") or "")
        + sum(len(jsonio.dumps(c["arguments"], python_text=True)) for c in m.get("tool_calls", []))
        for m in messages[1:]
    )


def clear_old_results(messages: list[dict], clear_chars: int = CLEAR_CHARS) -> list[dict]:
    """The conversation with every tool result before the last assistant turn replaced by CLEARED,
    once it is longer than `clear_chars` (else unchanged)."""
    if conversation_chars(messages) <= clear_chars:
        return messages
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    return [{**m, "content": CLEARED} if m["role"] == "tool" and i < last else m for i, m in enumerate(messages)]


def make_openai_body(model: str, messages: list[dict], max_tokens: int, tools: bool) -> dict:
    """A chat completions body from the agent's conversation (OpenAI-style messages, parsed calls)."""
    wire = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": jsonio.dumps(c["arguments"], python_text=True)},
                }
                for c in m["tool_calls"]
            ]
            wire.append({"role": "assistant", "content": m["content"] or None, "tool_calls": calls})
        elif m["role"] == "tool":
            wire.append({"role": "tool", "tool_call_id": m["tool_call_id"], "content": m["content"]})
        else:
            wire.append({"role": m["role"], "content": m["content"]})
    body = {"model": model, "messages": wire, "max_tokens": max_tokens}
    if tools:
        body["tools"] = [{"type": "function", "function": t} for t in TOOLS]
    return body


def make_anthropic_body(model: str, messages: list[dict], max_tokens: int, tools: bool) -> dict:
    """A Messages API body from the same conversation (tool results become user tool_result blocks)."""
    wire: list[dict] = []
    for m in messages[1:]:
        if m["role"] == "assistant":
            blocks = [{"type": "text", "text": m["content"]}] if m["content"] else []
            blocks += [
                {"type": "tool_use", "id": c["id"], "name": c["name"], "input": c["arguments"]}
                for c in m.get("tool_calls", [])
            ]
            wire.append({"role": "assistant", "content": blocks or [{"type": "text", "text": ""}]})
        elif m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            if wire and wire[-1]["role"] == "user" and isinstance(wire[-1]["content"], list):
                wire[-1]["content"].append(block)
            else:
                wire.append({"role": "user", "content": [block]})
        elif wire and wire[-1]["role"] == "user":  # a text after tool results joins their message
            wire[-1]["content"].append({"type": "text", "text": m["content"]})
        else:
            wire.append({"role": "user", "content": [{"type": "text", "text": m["content"]}]})
    body = {"model": model, "system": messages[0]["content"], "messages": wire, "max_tokens": max_tokens}
    if tools:
        body["tools"] = [
            {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS
        ]
    return body


def make_agent_headers(api: str, agent_id: str | None, parent_id: str | None) -> dict[str, str]:
    """Headers naming a sub-agent and its spawner (none for the main agent)."""
    if agent_id is None:
        return {}
    prefix = "x-claude-code" if api == "anthropic" else "x-gyre"
    return {f"{prefix}-agent-id": agent_id, **({f"{prefix}-parent-agent-id": parent_id} if parent_id else {})}


def run_tool(name: str, args: dict, workspace: Path) -> str:
    """Execute one tool call in the workspace; failures are results the model reads, not crashes."""
    try:
        if name == "write_file":
            text = str(args.get("content", ""))
            (workspace / str(args["path"])).write_text(text)
            return f"wrote {len(text)} bytes to {args['path']}"
        if name == "read_file":
            return (workspace / str(args["path"])).read_text(errors="replace")[:RESULT_CHARS]
        if name == "run":
            done = subprocess.run(
                str(args["command"]), shell=True, cwd=workspace, capture_output=True, text=True, timeout=30
            )
            return f"exit {done.returncode}\n{(done.stdout + done.stderr)[:RESULT_CHARS]}"
        return f"error: unknown tool {name!r}; valid: write_file, read_file, run"
    except (OSError, KeyError, subprocess.TimeoutExpired) as e:
        print(f"toy-agent: tool {name} failed: {e!r}", file=sys.stderr, flush=True)
        return f"error: {e}"


class ApiCallError(Exception):
    """The proxy refused a call, or failed it past the retries (the agent ends: a harness error)."""


class ApiClient:
    """The agent's HTTP client for one API: the SDKs' retries (connection errors and
    RETRY_STATUSES, MAX_RETRIES times, exponential backoff from 0.5 s to 8 s, Retry-After
    honoured) through urllib3's Retry, their timeout, and their authentication headers."""

    def __init__(self, api: str, base_url: str, api_key: str):
        retry = Retry(
            total=MAX_RETRIES,
            allowed_methods=None,  # every call is a POST; the SDKs retry them all
            status_forcelist=RETRY_STATUSES,
            backoff_factor=0.5,
            backoff_max=8.0,
            raise_on_status=False,  # the last answer's body goes into the error
        )
        self.session = requests.Session()
        self.session.mount("http://", HTTPAdapter(max_retries=retry))
        self.session.mount("https://", HTTPAdapter(max_retries=retry))
        if api == "anthropic":
            self.url = f"{base_url}/v1/messages"
            self.session.headers.update({"x-api-key": api_key, "anthropic-version": ANTHROPIC_VERSION})
        else:
            self.url = f"{base_url}/v1/chat/completions"
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def post(self, body: dict, headers: dict[str, str]) -> dict:
        """The answer to one call.

        Raises:
            ApiCallError: an error status (after the retries, for those retried), with its body.
            requests.RequestException: the proxy could not be reached or did not answer in time.
        """
        r = self.session.post(self.url, json=body, headers=headers, timeout=TIMEOUT_S)
        if r.status_code >= 400:
            raise ApiCallError(f"POST {self.url} answered {r.status_code}: {r.text[:2000]}")
        return r.json()


class ToyAgent:
    """One execution's agents (main, sub-agent) over one API client."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.workspace = args, Path.cwd()
        seed = int.from_bytes(
            hashlib.sha256(f"{args.seed}:{os.environ.get('GYRE_EXECUTION_ID', '')}".encode()).digest()[:8], "little"
        )
        self.rng = random.Random(seed)
        self.tool_time = ToolTime(args.tool_median_s, args.tool_sigma, args.tool_max_s)
        self.client = ApiClient(args.api, os.environ["GYRE_PROXY_URL"], os.environ["GYRE_API_KEY"])
        self.num_calls = 0
        self.session = Path(os.environ.get("HOME", ".")) / SESSION_FILE
        """Where the agent keeps what continuing needs, rewritten whole after every turn."""
        self.state = self._load_session()

    def _load_session(self) -> dict:
        """The saved session (a continued execution), else a fresh one."""
        try:
            state = jsonio.loads(self.session.read_text())
        except (OSError, ValueError):
            return {"stage": "survey", "report": "", "agent": None}
        version, internal, gauss = state.pop("rng")
        self.rng.setstate((version, tuple(internal), gauss))
        self.num_calls = state["num_calls"]
        print(f"toy-agent: continuing its session at stage {state['stage']}", file=sys.stderr, flush=True)
        return state

    def _save(self, **changes) -> None:
        """The session after a whole turn (its tool results in): continuing from here re-sends it as it was."""
        self.state.update(changes)
        blob = jsonio.dumps(self.state | {"num_calls": self.num_calls, "rng": self.rng.getstate()})
        write_atomic(self.session, blob)  # a continued agent reads the old turn or the new one, never half

    def call(self, messages: list[dict], agent_id: str | None, tools: bool = True, summary: bool = False) -> dict:
        """One model call; returns the assistant message (content, parsed tool calls with ids)."""
        a = self.args
        headers = make_agent_headers(a.api, agent_id, "main" if agent_id else None)
        if summary and a.api == "openai":
            headers["x-gyre-call-kind"] = "summary"
        self.num_calls += 1
        if a.api == "anthropic":
            blocks = self.client.post(make_anthropic_body(a.model, messages, a.max_tokens, tools), headers)["content"]
            text = "".join(b["text"] for b in blocks if b["type"] == "text")
            calls = [
                {"id": b["id"], "name": b["name"], "arguments": dict(b["input"])}
                for b in blocks
                if b["type"] == "tool_use"
            ]
        else:
            msg = self.client.post(make_openai_body(a.model, messages, a.max_tokens, tools), headers)["choices"][0]
            msg = msg["message"]
            text = msg.get("content") or ""
            calls = [
                {
                    "id": c["id"],
                    "name": c["function"]["name"],
                    "arguments": jsonio.loads(c["function"].get("arguments") or "{}"),
                }
                for c in msg.get("tool_calls") or []
            ]
        return {"role": "assistant", "content": text, "tool_calls": calls}

    def tools_round(self, reply: dict, messages: list[dict]) -> None:
        for c in reply["tool_calls"]:
            start = time.monotonic()
            result = run_tool(c["name"], c["arguments"], self.workspace)
            time.sleep(max(0.0, self.tool_time.draw(self.rng) - (time.monotonic() - start)))
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})

    def run_agent(self, system: str, prompt: str, agent_id: str | None, max_turns: int) -> str:
        """Turns until a reply without tool calls (its text is returned) or `max_turns`; a saved
        session of this stage continues where its last whole turn ended."""
        saved = self.state["agent"] or {}
        messages = saved.get("messages") or [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
        agent_id, reply = saved.get("agent_id", agent_id), {"content": saved.get("reply", "")}
        for turn in range(saved.get("turn", 0), max_turns):
            messages = clear_old_results(messages, self.args.clear_chars)
            reply = self.call(messages, agent_id)
            messages.append(reply)
            if not reply["tool_calls"]:
                break
            self.tools_round(reply, messages)
            if agent_id is None and conversation_chars(messages) > self.args.compact_chars:
                summary = self.call(messages + [{"role": "user", "content": SUMMARY_REQUEST}], None, summary=True)
                print(f"toy-agent: compacted {conversation_chars(messages)} chars", file=sys.stderr, flush=True)
                messages = [
                    messages[0],
                    {"role": "user", "content": make_resumed_prompt(self.args.instruction, summary["content"])},
                ]
            self._save(agent={"agent_id": agent_id, "messages": messages, "turn": turn + 1, "reply": reply["content"]})
        return reply["content"]

    def run(self) -> None:
        """The survey, the main agent, the verification: each stage saved as it ends, so a continued
        execution (its session file in HOME) picks up at the stage and turn it had reached."""
        a = self.args
        if self.state["stage"] == "survey":
            report = (
                self.run_agent(SUB_SYSTEM, SUB_TASK, f"sub-{uuid.uuid4().hex[:8]}", a.subagent_turns)
                if a.subagent
                else ""
            )
            self._save(stage="main", report=report, agent=None)
        if self.state["stage"] == "main":
            self.run_agent(MAIN_SYSTEM, make_main_prompt(a.instruction, self.state["report"]), None, a.max_turns)
            self._save(stage="verify", agent=None)
        if self.state["stage"] == "verify":
            if a.verify:
                report = self.run_agent(SUB_SYSTEM, SUB_TASK, f"sub-{uuid.uuid4().hex[:8]}", a.subagent_turns)
                print(f"toy-agent: verified: {report[:RESULT_CHARS]!r}", file=sys.stderr, flush=True)
            self._save(stage="done", agent=None)
        print(jsonio.dumps({"num_calls": self.num_calls}), flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gyre.harness.toy_agent", description=__doc__.split("\n\n")[0])
    p.add_argument("instruction")
    p.add_argument("--api", choices=APIS, default="openai")
    p.add_argument("--model", default=os.environ.get("GYRE_MODEL", "gyre"))
    p.add_argument("--max-tokens", type=int, default=96, help="new tokens per call")
    p.add_argument("--max-turns", type=int, default=4, help="main-agent model calls (summaries aside)")
    p.add_argument("--subagent", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--subagent-turns", type=int, default=2)
    p.add_argument(
        "--clear-chars", type=int, default=CLEAR_CHARS, help="clear old tool results past this many characters"
    )
    p.add_argument("--compact-chars", type=int, default=400, help="compact once the conversation exceeds this")
    p.add_argument("--tool-median-s", type=float, default=0.05)
    p.add_argument("--tool-sigma", type=float, default=2.5)
    p.add_argument("--tool-max-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0, help="tool durations: seeded by this and GYRE_EXECUTION_ID")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    ToyAgent(parse_args(argv)).run()


if __name__ == "__main__":
    main()
