"""Command lines and environments of the supported harnesses (pure), and one bounded runner.

Claude Code (npm `@anthropic-ai/claude-code`, pinned in tools/setup.sh) runs offline against the
proxy: as root it needs IS_SANDBOX=1 for --dangerously-skip-permissions; telemetry and other
non-essential traffic are off; HOME is a per-execution directory (its sessions live there, so
`--continue` finds them). Every model alias points at the served model so auxiliary calls reach
the proxy too. mini-swe-agent (PyPI) speaks OpenAI chat completions through litellm (~8 CPU-s
to import per process); its model classes without litellm (openrouter, requesty) hard-code their
service URLs, so litellm's `openai/` route with `api_base` is its only way to reach a proxy.
Codex CLI (npm `@openai/codex`, pinned in tools/setup.sh) speaks only the Responses API; `codex
exec` reaches the proxy through a custom model provider given with `-c` overrides (`wire_api =
"responses"`, the key from an environment variable), with CODEX_HOME a per-execution directory.
Qwen Code (npm `@qwen-code/qwen-code`, a Node script) speaks OpenAI chat completions, streamed, to
OPENAI_BASE_URL with OPENAI_API_KEY (`--auth-type openai`); besides the agent's calls it sends an
auxiliary memory-extraction call per session. Its settings and sessions live under $HOME/.qwen.
"""

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from gyre.common import jsonio

CLAUDE_CODE_VERSION = "2.1.220"
MINI_SWE_AGENT_VERSION = "2.4.6"
CODEX_VERSION = "0.171.0"
QWEN_CODE_VERSION = "0.24.4"


def find_claude_code() -> str | None:
    """The `claude` binary: $GYRE_CLAUDE_CODE, else the one tools/setup.sh installs into the venv."""
    for candidate in (os.environ.get("GYRE_CLAUDE_CODE"), str(Path(sys.prefix) / "harness/node_modules/.bin/claude")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def find_mini_swe_agent() -> str | None:
    """The `mini` entry point of mini-swe-agent in this venv, if installed."""
    path = Path(sys.prefix) / "bin/mini"
    return str(path) if path.exists() else shutil.which("mini")


def make_claude_code_env(base: dict[str, str], proxy_url: str, api_key: str, home: str, model: str) -> dict[str, str]:
    aliases = (
        "ANTHROPIC_MODEL",
        "ANTHROPIC_SMALL_FAST_MODEL",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL",
        "ANTHROPIC_DEFAULT_SONNET_MODEL",
        "ANTHROPIC_DEFAULT_OPUS_MODEL",
        "CLAUDE_CODE_SUBAGENT_MODEL",
    )
    return {
        **base,
        **{a: model for a in aliases},
        "HOME": home,
        "IS_SANDBOX": "1",
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "ANTHROPIC_BASE_URL": proxy_url,
        "ANTHROPIC_API_KEY": api_key,
    }


CONTINUE_PROMPT = "Continue the task where you left off."
"""The user turn a harness continuing its session after a restart gets (input, never trained)."""


def harness_session_id(execution_id: str) -> str:
    """The Claude Code or Qwen Code session an execution runs in (`--session-id`), the same after a
    restart (`--resume`)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"gyre-execution:{execution_id}"))


SESSION_TRANSCRIPTS = {"claude_code": ".claude/projects/*/{id}.jsonl", "qwen_code": ".qwen/projects/*/chats/{id}.jsonl"}
"""Where in $HOME Claude Code and Qwen Code keep a session's transcript (`*`: their cwd, sanitised)."""


def session_transcript(kind: str, home: Path, session_id: str) -> Path | None:
    """The transcript of session `session_id` of harness `kind` (a SESSION_TRANSCRIPTS key), found
    by the id (unique: the folder's name follows the harness's own sanitising of the cwd)."""
    return next(iter(sorted(home.glob(SESSION_TRANSCRIPTS[kind].format(id=session_id)))), None)


def codex_thread_id(events: str) -> str | None:
    """The thread a `codex exec --json` run started (its `thread.started` event), from its output."""
    for line in events.splitlines():
        try:
            event = jsonio.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("type") == "thread.started":
            return event.get("thread_id")
    return None


def trim_torn_line(path: Path) -> None:
    """Drop a half-written last line (the harness was killed mid-write) before a harness reads it again."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def make_claude_code_command(
    binary: str,
    prompt: str,
    *,
    model: str,
    tools: list[str],
    session_id: str | None = None,
    resume: bool = False,
    bare: bool = False,
) -> list[str]:
    """`claude -p PROMPT` with JSON output in session `session_id` (`--session-id`); `resume`
    continues that session (`--resume ID`; without an id, the last one: `--continue`).

    `bare` is Claude Code's documented minimal mode for scripted runs (no hooks, LSP, plugin sync,
    auto-memory, background prefetches or CLAUDE.md discovery): a ~2.5k-token system prompt, the
    same for every session, instead of ~9.5k with per-session paths, and about a third less CPU.
    """
    cmd = [
        binary,
        "-p",
        prompt,
        "--dangerously-skip-permissions",
        "--model",
        model,
        "--tools",
        ",".join(tools),
        "--output-format",
        "json",
    ]
    if session_id is not None:
        cmd += ["--resume", session_id] if resume else ["--session-id", session_id]
    elif resume:
        cmd.append("--continue")
    return cmd + (["--bare"] if bare else [])


def find_codex() -> str | None:
    """The `codex` binary: $GYRE_CODEX, else the native one the npm package ships (a static musl
    build under @openai/codex-<platform>/vendor: no Node needed where it runs, e.g. a task's image),
    else its Node launcher, as tools/setup.sh installs them into the venv."""
    modules = Path(sys.prefix) / "harness/node_modules"
    native = sorted(modules.glob("@openai/codex-linux-*/vendor/*/bin/codex"))
    for candidate in (os.environ.get("GYRE_CODEX"), *map(str, native), str(modules / ".bin/codex")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def make_codex_env(base: dict[str, str], api_key: str, home: str) -> dict[str, str]:
    """CODEX_HOME and HOME in the execution's directory; the proxy key in GYRE_API_KEY."""
    return {**base, "CODEX_HOME": home, "HOME": home, "GYRE_API_KEY": api_key, "NO_COLOR": "1"}


def make_codex_command(
    binary: str,
    prompt: str,
    *,
    proxy_url: str,
    model: str,
    instructions_file: str | None = None,
    resume: bool = False,
    thread_id: str | None = None,
) -> list[str]:
    """`codex exec PROMPT` (JSONL events on stdout) against the proxy as provider `gyre`, with no
    approvals or sandbox (the sandbox is Gyre's), web search off and no project docs read;
    `instructions_file` replaces Codex's built-in instructions (a shorter, fixed system prompt);
    `resume` continues thread `thread_id` (`codex exec resume THREAD`, the same `-c` options; without
    an id, the last one: `--last`)."""
    provider = f'{{name="gyre", base_url="{proxy_url}/v1", env_key="GYRE_API_KEY", wire_api="responses"}}'
    cmd = [
        binary,
        "exec",
        *(["resume", thread_id or "--last"] if resume else []),
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        "--json",
        "-m",
        model,
        "-c",
        "model_provider=gyre",
        "-c",
        f"model_providers.gyre={provider}",
        "-c",
        'web_search="disabled"',
        "-c",
        "project_doc_max_bytes=0",
        "-c",
        "features.multi_agent=false",
        "-c",
        "features.goals=false",
    ]
    if instructions_file:
        cmd += ["-c", f"model_instructions_file={instructions_file}"]
    return cmd + [prompt]


def find_qwen_code() -> str | None:
    """The `qwen` script: $GYRE_QWEN_CODE, else the one tools/setup.sh installs into the venv."""
    for candidate in (os.environ.get("GYRE_QWEN_CODE"), str(Path(sys.prefix) / "harness/node_modules/.bin/qwen")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def make_qwen_code_env(base: dict[str, str], proxy_url: str, api_key: str, home: str, model: str) -> dict[str, str]:
    """The proxy as Qwen Code's OpenAI endpoint; HOME (its .qwen settings and sessions) the execution's."""
    return {
        **base,
        "HOME": home,
        "OPENAI_BASE_URL": proxy_url + "/v1",
        "OPENAI_API_KEY": api_key,
        "OPENAI_MODEL": model,
        "NO_COLOR": "1",
        "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
    }


def make_qwen_code_command(
    binary: str,
    prompt: str,
    *,
    model: str,
    tools: list[str] | None = None,
    session_id: str | None = None,
    resume: bool = False,
) -> list[str]:
    """`qwen --yolo` (every tool approved: the sandbox is Gyre's), one-shot with JSON output, the
    OpenAI route with `model`, its core tools limited to `tools` (`--core-tools`; None: all), in
    session `session_id` (`--session-id`; `resume`: `--resume ID`); `--prompt=`, so a prompt
    starting with a dash stays a prompt (after `--` Qwen Code 0.24 reads no prompt at all)."""
    session = [] if session_id is None else ["--resume" if resume else "--session-id", session_id]
    core = [] if tools is None else ["--core-tools", *tools]
    return [binary, "--yolo", "--auth-type", "openai", "-m", model, "-o", "json", *core, *session, f"--prompt={prompt}"]


def make_mini_swe_env(base: dict[str, str], home: str) -> dict[str, str]:
    return {
        **base,
        "HOME": home,
        "MSWEA_CONFIGURED": "true",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "MSWEA_GLOBAL_CONFIG_DIR": str(Path(home) / ".mswea"),
    }


MINI_SWE_SESSION_FILE = "mini-session.jsonl"
"""mini-swe-agent's session in its HOME (which survives the job): one line per step, the messages
that step added, appended by gyre/harness/mini_swe_session.py; a continued execution reloads it."""
MINI_SWE_AGENT_CLASS = "gyre.harness.mini_swe_session.MiniSessionAgent"


def read_mini_swe_session(path: Path) -> list[dict]:
    """The messages of a mini-swe-agent session file, in order; a step whose line the kill cut
    short is trimmed from the file first (the agent appends after what it read)."""
    trim_torn_line(path)
    return [message for line in path.read_text().splitlines() if line for message in jsonio.loads(line)]


def append_mini_swe_step(path: Path, messages: list[dict]) -> None:
    """Append one step's messages as one line: a kill mid-write tears that line only."""
    with open(path, "a") as f:
        f.write(jsonio.dumps(messages) + "\n")


def make_mini_swe_command(
    binary: str,
    task: str,
    *,
    proxy_url: str,
    model: str,
    output: str,
    session_file: str | None = None,
    resume: bool = False,
) -> list[str]:
    """`mini` in yolo mode, exiting when the agent submits; litellm's OpenAI route to the proxy. The
    execution's key goes by the environment (OPENAI_API_KEY), never argv, which `ps` shows to all.
    With `session_file`, Gyre's agent class keeps its session there; `resume` continues it."""
    session = (
        ["--agent-class", MINI_SWE_AGENT_CLASS, "-c", f"agent.session_file={session_file}"] if session_file else []
    )
    return [
        binary,
        "-y",
        "--exit-immediately",
        "-t",
        task,
        "-m",
        f"openai/{model}",
        "-o",
        output,
        "-c",
        "mini.yaml",
        "-c",
        f"model.model_kwargs.api_base={proxy_url}/v1",
        "-c",
        "agent.cost_limit=0",
        *session,
        *(["-c", "agent.resume=true"] if session_file and resume else []),
    ]


def run_harness(cmd: list[str], env: dict[str, str], cwd: str, timeout_s: float) -> subprocess.CompletedProcess:
    """Run one harness invocation to completion (killed after `timeout_s`)."""
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
