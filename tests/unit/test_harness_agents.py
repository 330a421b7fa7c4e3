"""Harness command lines and environments (pure): every model call must reach the proxy."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest

import gyre
from gyre.harness.agents import (
    MINI_SWE_AGENT_CLASS,
    harness_session_id,
    make_claude_code_command,
    make_claude_code_env,
    make_codex_command,
    make_mini_swe_command,
)


def test_claude_code_command_flags():
    plain = make_claude_code_command("claude", "do it", model="tiny", tools=["Bash", "Agent"])
    assert plain[:3] == ["claude", "-p", "do it"] and plain[plain.index("--tools") + 1] == "Bash,Agent"
    assert "--bare" not in plain and "--continue" not in plain
    both = make_claude_code_command("claude", "/compact", model="tiny", tools=["Bash"], resume=True, bare=True)
    assert both[-2:] == ["--continue", "--bare"] and both[both.index("--model") + 1] == "tiny"


def test_claude_code_env_points_every_model_at_the_proxy():
    env = make_claude_code_env({"PATH": "/bin", "ANTHROPIC_MODEL": "opus"}, "http://127.0.0.1:9", "k1", "/h", "tiny")
    assert (
        env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9" and env["ANTHROPIC_API_KEY"] == "k1" and env["HOME"] == "/h"
    )
    aliases = ["ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"]
    aliases += [f"ANTHROPIC_DEFAULT_{tier}_MODEL" for tier in ("HAIKU", "SONNET", "OPUS")]
    assert {a: env.get(a) for a in aliases} == dict.fromkeys(aliases, "tiny")  # any alias Claude Code may pick
    assert env["PATH"] == "/bin" and env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"


def test_mini_swe_command_uses_the_proxy_openai_endpoint():
    cmd = make_mini_swe_command("mini", "task", proxy_url="http://127.0.0.1:9", model="gyre", output="/o.json")
    assert cmd[cmd.index("-m") + 1] == "openai/gyre" and cmd[cmd.index("-o") + 1] == "/o.json"
    assert "model.model_kwargs.api_base=http://127.0.0.1:9/v1" in cmd and not any("api_key" in w for w in cmd)
    assert "--agent-class" not in cmd


def test_mini_swe_command_keeps_its_session_with_gyres_agent_class():
    start = make_mini_swe_command(
        "mini", "t", proxy_url="http://p", model="gyre", output="/o", session_file="/h/s.jsonl"
    )
    assert start[start.index("--agent-class") + 1] == MINI_SWE_AGENT_CLASS and "agent.session_file=/h/s.jsonl" in start
    again = make_mini_swe_command(
        "mini", "t", proxy_url="http://p", model="gyre", output="/o", session_file="/h/s.jsonl", resume=True
    )
    assert "agent.resume=true" not in start and again[-2:] == ["-c", "agent.resume=true"]
    module, name = MINI_SWE_AGENT_CLASS.rsplit(".", 1)
    assert name in (Path(gyre.__file__).parent / "harness" / f"{module.rsplit('.', 1)[1]}.py").read_text()


def test_codex_harness_runs_exec_against_the_proxy_as_its_provider(tmp_path, monkeypatch):
    from gyre.harness.commands import make_harness_command
    from gyre.harness.config import HarnessConfig

    binary = tmp_path / "codex"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("GYRE_CODEX", str(binary))
    argv, env = make_harness_command(
        HarnessConfig(kind="codex"), "fix it", tmp_path, "http://127.0.0.1:9", "k1", "gyre", tmp_path / "home"
    )
    assert argv[:3] == [str(binary), "exec", "--skip-git-repo-check"] and "fix it" in argv
    assert any('base_url="http://127.0.0.1:9/v1"' in a and 'wire_api="responses"' in a for a in argv)
    assert env["GYRE_API_KEY"] == "k1" and env["CODEX_HOME"] == str(tmp_path / "home")


def test_an_interrupted_execution_continues_only_where_its_session_survived(tmp_path):
    """continuable: the toy agent's saved session and workspace, a task without a Harbor environment;
    every other case says why it is re-run instead."""
    from dataclasses import replace
    from types import SimpleNamespace

    from gyre.harness.agents import (
        MINI_SWE_SESSION_FILE,
        codex_thread_id,
        harness_session_id,
        session_transcript,
        trim_torn_line,
    )
    from gyre.harness.config import HarnessConfig
    from gyre.harness.sandbox import continuable
    from gyre.harness.toy_agent import SESSION_FILE

    task, toy = SimpleNamespace(environment=None), HarnessConfig(kind="toy")
    assert "no workspace" in continuable(task, toy, tmp_path)
    (tmp_path / "workspace").mkdir()
    (tmp_path / "home").mkdir()
    assert "no saved session" in continuable(task, toy, tmp_path)
    (tmp_path / "home" / SESSION_FILE).write_text("{}")
    assert continuable(task, toy, tmp_path) is None
    assert "outlive the job" in continuable(SimpleNamespace(environment=object()), toy, tmp_path)
    assert "does not continue" in continuable(task, replace(toy, kind="command", command="true"), tmp_path)
    mini = replace(toy, kind="mini_swe_agent")
    assert "no saved session" in continuable(task, mini, tmp_path)
    (tmp_path / "home" / MINI_SWE_SESSION_FILE).write_text("")  # Gyre's agent class appends to it
    assert continuable(task, mini, tmp_path) is None
    claude = replace(toy, kind="claude_code")
    assert "no saved claude_code session" in continuable(task, claude, tmp_path)
    sid = harness_session_id(tmp_path.name)  # the sandbox folder is named after the execution
    transcript = tmp_path / "home" / ".claude" / "projects" / "-some-cwd" / f"{sid}.jsonl"
    transcript.parent.mkdir(parents=True)
    transcript.write_bytes(b'{"type": "user"}\n{"type": "assis')  # killed mid-write
    assert continuable(task, claude, tmp_path) is None
    assert session_transcript("claude_code", tmp_path / "home", sid) == transcript
    trim_torn_line(transcript)
    assert transcript.read_bytes() == b'{"type": "user"}\n'
    qwen = replace(toy, kind="qwen_code")
    assert "no saved qwen_code session" in continuable(task, qwen, tmp_path)  # Claude Code's is not Qwen Code's
    chats = tmp_path / "home" / ".qwen" / "projects" / "-some-cwd" / "chats"
    chats.mkdir(parents=True)
    (chats / f"{sid}.jsonl").write_text('{"type": "user"}\n')
    assert continuable(task, qwen, tmp_path) is None
    codex = replace(toy, kind="codex")
    assert "thread.started" in continuable(task, codex, tmp_path)
    (tmp_path / "harness.log").write_text('warming up\n{"type":"thread.started","thread_id":"t-42"}\n')
    assert (
        continuable(task, codex, tmp_path) is None and codex_thread_id((tmp_path / "harness.log").read_text()) == "t-42"
    )


def test_qwen_code_starts_and_continues_the_executions_session(tmp_path, monkeypatch):
    from gyre.harness.agents import CONTINUE_PROMPT
    from gyre.harness.commands import HarnessSession, make_harness_command
    from gyre.harness.config import HarnessConfig

    binary = tmp_path / "qwen"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("GYRE_QWEN_CODE", str(binary))
    cfg, home = HarnessConfig(kind="qwen_code"), tmp_path / "home"
    start, env = make_harness_command(
        cfg, "fix it", tmp_path, "http://127.0.0.1:9", "k1", "gyre", home, HarnessSession("s-1")
    )
    again, _ = make_harness_command(
        cfg, "fix it", tmp_path, "http://127.0.0.1:9", "k1", "gyre", home, HarnessSession("s-1", resume=True)
    )
    assert start[start.index("--session-id") + 1] == "s-1" and start[-1] == "--prompt=fix it"
    assert again[again.index("--resume") + 1] == "s-1" and again[-1] == f"--prompt={CONTINUE_PROMPT}"
    assert "--resume" not in start and "--session-id" not in again
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1" and env["HOME"] == str(home)
    assert "--core-tools" not in start  # all of its tools unless harness.qwen_code_tools names some
    shell, _ = make_harness_command(
        replace(cfg, qwen_code_tools=["run_shell_command", "read_file"]), "fix it", tmp_path, "http://x", "k", "m", home
    )
    assert shell[shell.index("--core-tools") + 1 : -1] == ["run_shell_command", "read_file"]


def test_claude_code_and_codex_continue_their_own_session_by_id():
    start = make_claude_code_command("claude", "task", model="tiny", tools=["Bash"], session_id="s-1")
    again = make_claude_code_command("claude", "go on", model="tiny", tools=["Bash"], session_id="s-1", resume=True)
    assert start[start.index("--session-id") + 1] == "s-1" and again[again.index("--resume") + 1] == "s-1"
    assert "--continue" not in again and harness_session_id("g00001-3") == harness_session_id("g00001-3")
    cx = make_codex_command("codex", "go on", proxy_url="http://p", model="gyre", resume=True, thread_id="t-42")
    assert cx[1:4] == ["exec", "resume", "t-42"] and cx[-1] == "go on" and "--last" not in cx


def test_qwen_code_runs_one_shot_against_the_proxy_as_its_openai_endpoint(tmp_path, monkeypatch):
    from gyre.harness.commands import HarnessNotFound, make_harness_command
    from gyre.harness.config import HarnessConfig

    binary = tmp_path / "qwen"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("GYRE_QWEN_CODE", str(binary))
    cfg = HarnessConfig(kind="qwen_code")
    argv, env = make_harness_command(cfg, "-fix it", tmp_path, "http://127.0.0.1:8000", "key-1", "gyre", tmp_path / "h")
    assert argv == [str(binary), "--yolo", "--auth-type", "openai", "-m", "gyre", "-o", "json", "--prompt=-fix it"]
    assert (env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"], env["OPENAI_MODEL"]) == (
        "http://127.0.0.1:8000/v1",
        "key-1",
        "gyre",
    )
    assert env["HOME"] == str(tmp_path / "h") and "key-1" not in argv
    monkeypatch.delenv("GYRE_QWEN_CODE")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "no-venv"))
    with pytest.raises(HarnessNotFound, match="Qwen Code is not installed"):
        make_harness_command(cfg, "x", tmp_path, "http://h:1", "k", "m", tmp_path / "h")
