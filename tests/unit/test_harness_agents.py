"""Harness command lines and environments (pure): every model call must reach the proxy."""

from gyre.harness.agents import make_claude_code_command, make_claude_code_env, make_mini_swe_command


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

    from gyre.harness.config import HarnessConfig
    from gyre.harness.sandbox import continuable
    from gyre.harness.toy_agent import SESSION_FILE

    task, toy = SimpleNamespace(environment=None), HarnessConfig(kind="toy")
    assert "no saved session" in continuable(task, toy, tmp_path)
    (tmp_path / "workspace").mkdir()
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / SESSION_FILE).write_text("{}")
    assert continuable(task, toy, tmp_path) is None
    assert "outlive the job" in continuable(SimpleNamespace(environment=object()), toy, tmp_path)
    assert "does not continue" in continuable(task, replace(toy, kind="claude_code"), tmp_path)
