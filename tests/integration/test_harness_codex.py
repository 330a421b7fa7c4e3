"""SLOW (under a minute): real Codex CLI 0.171.0 through the proxy's Responses API and a builtin
engine running a scripted policy: a shell command, then a resumed session; its records must form
one token-faithful chain (every call extends the previous one, nothing re-tokenized). Skipped
without the npm package (tools/setup.sh installs it)."""

import dataclasses
import json
import os

import pytest
from proxy_fixtures import MODEL, new_execution, start_engine, start_proxy

from gyre.harness.agents import codex_thread_id, find_codex, make_codex_command, make_codex_env, run_harness
from gyre.records.io import read_records
from gyre.trajectory.tree import build_call_tree

pytestmark = pytest.mark.slow


def tool_call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


RULES = [  # first match wins, on the prompt text the model has not answered yet (gyre.engines.scripted)
    {"match": "CODEX-STEP-DONE", "emit": "The marker is written. CODEX-COMPLETE"},
    {
        "match": "TASK-CODEX",
        "emit": "I will run it. " + tool_call("exec_command", {"cmd": "echo CODEX-STEP-DONE | tee step.txt"}),
    },
    {"match": "TASK-AGAIN", "emit": "Still done. CODEX-AGAIN"},
    {"match": ".", "emit": "Nothing to do."},
]


def agent_messages(stdout: str) -> list[str]:
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert not [e for e in events if e["type"] in ("error", "turn.failed")], stdout
    return [e["item"]["text"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]


def test_codex_runs_a_command_and_resumes(tmp_path):
    binary = find_codex()
    if binary is None:
        pytest.skip("Codex CLI not installed: run tools/setup.sh (or set GYRE_CODEX)")
    engine = start_engine(tmp_path, RULES, model=dataclasses.replace(MODEL, max_seq_len=65536))
    proxy = start_proxy(tmp_path, [engine.url], context_len=65536)
    try:
        key = new_execution(proxy, "cx")
        for d in ("home", "ws"):
            (tmp_path / d).mkdir()
        (tmp_path / "instructions.md").write_text("You are a coding agent. Run shell commands with exec_command.\n")
        env = make_codex_env(dict(os.environ), key, str(tmp_path / "home"))

        def run(prompt, thread=None):
            instructions = str(tmp_path / "instructions.md")
            command = make_codex_command(
                binary,
                prompt,
                proxy_url=proxy.url,
                model="gyre",
                resume=thread is not None,
                thread_id=thread,
                instructions_file=instructions,
            )
            return run_harness(command, env, str(tmp_path / "ws"), 300)

        first = run("TASK-CODEX: write the marker")
        assert first.returncode == 0, first.stdout + first.stderr
        assert agent_messages(first.stdout)[-1] == "The marker is written. CODEX-COMPLETE"
        assert (tmp_path / "ws" / "step.txt").read_text() == "CODEX-STEP-DONE\n"  # the command really ran
        thread = codex_thread_id(first.stdout)  # what a continued execution reads back from its log
        assert thread
        second = run("TASK-AGAIN: check once more", thread)  # codex exec resume THREAD
        assert second.returncode == 0, second.stdout + second.stderr
        assert agent_messages(second.stdout)[-1] == "Still done. CODEX-AGAIN"
    finally:
        proxy.stop()
        engine.stop()

    records, stats = read_records(tmp_path / "records" / "cx.jsonl")
    assert stats.num_torn == 0 and not stats.invalid and len(records) == 3
    tree = build_call_tree(records)
    assert tree.missing_seqs == [] and all(r.hints["api"] == "responses" for r in records)
    for i, node in enumerate(tree.nodes[1:], start=1):  # one chain across the resumed session
        assert node.parent == i - 1 and node.shared >= tree.nodes[i - 1].end, f"call {i} does not extend call {i - 1}"
    assert all(r.hints["retokenized_turns"] == 0 for r in records)
    assert [r.hints["rendered_messages"] for r in records[1:]] == [2, 2]  # each later call rendered only what it added
