"""The argv and environment of each harness kind for one execution (pure but for finding binaries)."""

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from gyre.errors import GyreError
from gyre.harness import agents
from gyre.harness.config import HarnessConfig


class HarnessNotFound(GyreError):
    """The harness program is not installed (tools/setup.sh installs Claude Code and mini-swe-agent)."""


def make_toy_command(cfg: HarnessConfig, instruction: str, model: str) -> list[str]:
    t = cfg.toy
    return [
        sys.executable,
        "-m",
        "gyre.harness.toy_agent",
        instruction,
        "--api",
        t.api,
        "--model",
        model,
        "--max-tokens",
        str(t.max_tokens),
        "--max-turns",
        str(t.max_turns),
        "--subagent" if t.subagent else "--no-subagent",
        "--verify" if t.verify else "--no-verify",
        "--subagent-turns",
        str(t.subagent_turns),
        "--clear-chars",
        str(t.clear_chars),
        "--compact-chars",
        str(t.compact_chars),
        "--tool-median-s",
        str(t.tool_median_s),
        "--tool-sigma",
        str(t.tool_sigma),
        "--tool-max-s",
        str(t.tool_max_s),
        "--seed",
        str(t.seed),
    ]


def make_template_command(template: str, values: dict[str, str]) -> list[str]:
    """Split `template` like a shell, then fill each word's placeholders (values stay one word)."""
    return [word.format(**values) for word in shlex.split(template)]


@dataclass(frozen=True)
class HarnessSession:
    """The harness session an execution runs in: Claude Code's or Qwen Code's session id, Codex's
    thread (known once it started), and whether this start continues it after a restart (then
    Claude Code, Qwen Code and Codex get a short continue prompt instead of the instruction; mini-swe-agent reloads its
    session file and goes on; the toy agent finds its own session file)."""

    id: str | None
    resume: bool = False


def _qwen_code_command(
    cfg: HarnessConfig,
    instruction: str,
    proxy_url: str,
    api_key: str,
    model: str,
    home: Path,
    env: dict[str, str],
    session: HarnessSession,
) -> tuple[list[str], dict[str, str]]:
    """Qwen Code's (argv, env): one-shot, the proxy as its OpenAI endpoint, in the execution's session."""
    binary = agents.find_qwen_code()
    if binary is None:
        raise HarnessNotFound("Qwen Code is not installed (tools/setup.sh, or set GYRE_QWEN_CODE)")
    prompt = agents.CONTINUE_PROMPT if session.resume else instruction
    argv = agents.make_qwen_code_command(
        binary, prompt, model=model, tools=cfg.qwen_code_tools, session_id=session.id, resume=session.resume
    )
    return argv, agents.make_qwen_code_env(env, proxy_url, api_key, str(home), model)


def make_harness_command(
    cfg: HarnessConfig,
    instruction: str,
    workspace: Path,
    proxy_url: str,
    api_key: str,
    model: str,
    home: Path,
    session: HarnessSession = HarnessSession(None),
) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of the harness; env carries the proxy URL, the execution's key and the model
    under Gyre's names and the ones the OpenAI and Anthropic SDKs read.

    Raises:
        HarnessNotFound: claude_code / codex / qwen_code / mini_swe_agent not installed.
    """
    env = {
        **os.environ,
        "HOME": str(home),
        "GYRE_PROXY_URL": proxy_url,
        "GYRE_API_KEY": api_key,
        "GYRE_MODEL": model,
        "OPENAI_BASE_URL": proxy_url + "/v1",
        "OPENAI_API_KEY": api_key,
        "ANTHROPIC_BASE_URL": proxy_url,
        "ANTHROPIC_API_KEY": api_key,
    }
    if cfg.kind == "toy":
        return make_toy_command(cfg, instruction, model), env
    if cfg.kind == "qwen_code":
        return _qwen_code_command(cfg, instruction, proxy_url, api_key, model, home, env, session)
    if cfg.kind == "command":
        values = {
            "instruction": instruction,
            "workspace": str(workspace),
            "proxy_url": proxy_url,
            "api_key": api_key,
            "model": model,
        }
        return make_template_command(cfg.command, values), env
    if cfg.kind in ("claude_code", "codex"):
        prompt = agents.CONTINUE_PROMPT if session.resume else instruction
        return _agent_cli_command(cfg, prompt, proxy_url, api_key, model, home, env, session)
    binary = agents.find_mini_swe_agent()
    if binary is None:
        raise HarnessNotFound("mini-swe-agent is not installed (pip install -e '.[harness]')")
    argv = agents.make_mini_swe_command(
        binary,
        instruction,
        proxy_url=proxy_url,
        model=model,
        output=str(home / "trajectory.json"),
        session_file=str(home / agents.MINI_SWE_SESSION_FILE),
        resume=session.resume,
    )
    return argv, agents.make_mini_swe_env(env, str(home))


def _agent_cli_command(
    cfg: HarnessConfig,
    prompt: str,
    proxy_url: str,
    api_key: str,
    model: str,
    home: Path,
    env: dict[str, str],
    session: HarnessSession,
) -> tuple[list[str], dict[str, str]]:
    """Claude Code's or Codex's (argv, env), in the execution's session (continued after a restart)."""
    if cfg.kind == "claude_code":
        binary = agents.find_claude_code()
        if binary is None:
            raise HarnessNotFound("Claude Code is not installed (tools/setup.sh, or set GYRE_CLAUDE_CODE)")
        tools, sid = cfg.claude_code_tools, session.id
        argv = agents.make_claude_code_command(
            binary, prompt, model=model, tools=tools, session_id=sid, resume=session.resume, bare=True
        )
        return argv, agents.make_claude_code_env(env, proxy_url, api_key, str(home), model)
    binary = agents.find_codex()
    if binary is None:
        raise HarnessNotFound("Codex CLI is not installed (tools/setup.sh, or set GYRE_CODEX)")
    argv = agents.make_codex_command(
        binary, prompt, proxy_url=proxy_url, model=model, resume=session.resume, thread_id=session.id
    )
    return argv, agents.make_codex_env(env, api_key, str(home))
