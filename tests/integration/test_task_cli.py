"""`gyre-task`: check on the embedded toy set, list, and run with the command harness (own engine and proxy)."""

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from importlib import resources
from pathlib import Path

import pytest
from proxy_fixtures import MODEL, new_execution, start_engine, start_proxy

from gyre.harness.agents import find_claude_code, find_codex, find_qwen_code
from gyre.launch.task_cli import main


def gyre_task(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gyre.launch.task_cli", *args], capture_output=True, text=True, timeout=timeout_s
    )


def test_check_and_list(tmp_path):
    ids = [line.split("\t")[0] for line in gyre_task("list").stdout.splitlines()]
    assert len(ids) == 16 and ids[0] == "word-apple"  # the embedded toy set
    lines = (resources.files("gyre") / "tasks/toy/tasks.jsonl").read_text().splitlines()[:2]
    (tmp_path / "two.jsonl").write_text("\n".join(lines) + "\n")
    done = gyre_task("check", str(tmp_path / "two.jsonl"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["passed"] == 2
    broken = json.loads(lines[0]) | {"reference": {"files": {"answer.txt": "wrong"}}}
    river = json.loads(lines[1])  # an evaluator that crashes on the empty workspace instead of scoring it 0
    river["evaluator"]["command"] = "test -f answer.txt && " + river["evaluator"]["command"]
    (tmp_path / "broken.jsonl").write_text(json.dumps(broken) + "\n" + json.dumps(river) + "\n")
    done = gyre_task("check", str(tmp_path / "broken.jsonl"))
    assert done.returncode == 1 and "word-apple\tFAIL" in done.stdout
    assert "word-river\tFAIL\tempty=None reference=1.0" in done.stdout and "evaluator_errors=3" in done.stdout


ASK_THEN_ANSWER = """
import json, os, pathlib, sys, urllib.request
body = {"model": sys.argv[1], "max_tokens": 4, "messages": [{"role": "user", "content": "a river"}]}
req = urllib.request.Request(os.environ["GYRE_PROXY_URL"] + "/v1/chat/completions", json.dumps(body).encode(),
    {"Authorization": "Bearer " + os.environ["GYRE_API_KEY"], "Content-Type": "application/json"})
urllib.request.urlopen(req, timeout=120).read()
pathlib.Path("answer.txt").write_text("rivers")
"""


def test_run_command_harness_with_own_engine_and_proxy(tmp_path):
    (tmp_path / "agent.py").write_text(ASK_THEN_ANSWER)
    done = gyre_task(
        "run",
        "word-river",
        "--harness",
        "command",
        "--root",
        str(tmp_path / "run"),
        "--command",
        f"{sys.executable} {tmp_path / 'agent.py'} {{model}}",
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert (out["outcome"], out["reason"]) == ("finished", None) and 0.2 < out["score"] < 1.0  # a near miss
    assert out["workspace"].startswith(str(tmp_path)) and Path(out["records_path"]).stat().st_size > 0
    assert out["duration_s"] > 0


@pytest.mark.parametrize(
    "command,calls,expect",
    [
        pytest.param("echo apple > answer.txt; exit 3", "", ("excluded", "harness_failed", None), id="crashed"),
        pytest.param("echo apple > answer.txt", "", ("excluded", "no_model_calls", None), id="no-calls"),
        pytest.param("echo apple > answer.txt; exit 3", "{}\n", ("finished", None, 1.0), id="called-then-failed"),
    ],
)
def test_run_against_a_given_proxy_scores_as_the_coordinator_does(tmp_path, capsys, command, calls, expect):
    """A harness with no model call is excluded unscored (harness_failed / no_model_calls), as in gyre-train."""
    records = tmp_path / "records.jsonl"
    records.write_text(calls)
    with pytest.raises(SystemExit) as done:  # in process: no engine or proxy of its own to start
        main(
            [
                "run",
                "word-apple",
                "--harness",
                "command",
                "--root",
                str(tmp_path),
                "--proxy",
                "http://127.0.0.1:9",
                "--key",
                "key-7",
                "--records",
                str(records),
                "--command",
                f"sh -c 'echo $GYRE_PROXY_URL $GYRE_API_KEY > seen.txt; {command}'",
            ]
        )
    assert done.value.code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["outcome"], out["reason"], out["score"], out["records_path"]) == (*expect, str(records))
    assert (Path(out["workspace"]) / "seen.txt").read_text().split() == ["http://127.0.0.1:9", "key-7"]


def test_run_against_a_given_proxy_needs_its_records(tmp_path):
    with pytest.raises(SystemExit, match="--records"):
        main(["run", "word-apple", "--root", str(tmp_path), "--proxy", "http://127.0.0.1:9", "--key", "k"])


CC_RULES = {
    "rules": [  # Claude Code writes the answer with its Bash tool, then stops
        {
            "match": 'Write "apple"',
            "emit": '<tool_call>\n{"name": "Bash", "arguments": {"command": "echo apple > answer.txt", '
            '"description": "write the answer"}}\n</tool_call>',
        },
        {"match": ".", "emit": "Done."},
    ]
}


@pytest.mark.slow
@pytest.mark.skipif(find_claude_code() is None, reason="Claude Code is not installed (tools/setup.sh)")
def test_run_claude_code_with_scripted_policy(tmp_path):
    (tmp_path / "rules.json").write_text(json.dumps(CC_RULES))
    done = gyre_task(
        "run",
        "word-apple",
        "--harness",
        "claude_code",
        "--root",
        str(tmp_path / "run"),
        "--scripted-policy",
        str(tmp_path / "rules.json"),
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert (out["outcome"], out["score"], out["timed_out"]) == ("finished", 1.0, False), done.stderr


def _tool_call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def _shell_rules(tool: str, key: str) -> dict:
    """A scripted policy that writes hello.txt with the harness's shell tool, then answers."""
    command = "echo hello > hello.txt && echo WROTE-HELLO"
    return {
        "rules": [
            {"match": "Managed memory", "emit": "Nothing to remember."},  # Qwen Code's memory extractor
            {"match": "WROTE-HELLO", "emit": "hello.txt now says hello. DONE"},
            {"match": "Write the word", "emit": "I will write it. " + _tool_call(tool, {key: command})},
            {"match": ".", "emit": "Nothing to do."},
        ]
    }


NATIVE_CODEX = (find_codex() or "").endswith("-musl/bin/codex")
HARNESS_RUNS = [  # (harness, its shell tool and argument, installed)
    pytest.param("codex", "exec_command", "cmd", NATIVE_CODEX, id="codex-native-binary"),
    pytest.param("qwen_code", "run_shell_command", "command", find_qwen_code() is not None, id="qwen_code"),
]


@pytest.mark.slow
@pytest.mark.parametrize("harness,tool,key,installed", HARNESS_RUNS)
def test_run_a_harbor_task_with_codex_native_and_qwen_code(harness, tool, key, installed, tmp_path):
    """gyre-task run --proxy: the harness in the Harbor bubblewrap root with its harness config (no
    RLIMIT_AS: Node's fetch cannot start under one), through a proxy to a scripted policy on the
    one-layer test model (the prompts are 50-61k byte tokens); the verifier scores 1."""
    if not installed:
        pytest.skip(f"{harness} is not installed (tools/setup.sh); Codex: its native binary")
    task = tmp_path / "set" / "hello-file"
    shutil.copytree(Path(__file__).resolve().parents[1] / "harbor_tasks" / "hello-file", task)
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace("timeout_sec = 60.0", "timeout_sec = 500.0", 1))  # a tiny model's prefill
    engine = start_engine(tmp_path, _shell_rules(tool, key)["rules"], model=replace(MODEL, max_seq_len=65536))
    proxy = start_proxy(tmp_path, [engine.url], context_len=65536)
    try:
        done = gyre_task(
            "run",
            str(task),
            "--harness",
            harness,
            "--root",
            str(tmp_path / "run"),
            "--proxy",
            proxy.url,
            "--key",
            new_execution(proxy, "hello"),
            "--records",
            str(tmp_path / "records" / "hello.jsonl"),
            # Qwen Code with its shell its one core tool: a prompt of ~61k byte tokens (all its tools: ~76k)
            *(["--set", f"harness.qwen_code_tools=[{tool}]"] if harness == "qwen_code" else []),
            timeout_s=580,
        )
    finally:
        proxy.stop()
        engine.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert (out["outcome"], out["score"], out["isolated"]) == ("finished", 1.0, True), done.stderr[-3000:]
