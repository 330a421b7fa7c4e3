"""SLOW (~20 s): real mini-swe-agent (PyPI) through the proxy's OpenAI API and a builtin engine
running a scripted policy edits a file with its bash tool and submits. (Harnesses under drains:
test_harness_drains.py.)"""

import json
import os

import pytest
from proxy_fixtures import new_execution, start_engine, start_proxy

from gyre.harness.agents import find_mini_swe_agent, make_mini_swe_command, make_mini_swe_env, run_harness
from gyre.records.io import read_records
from gyre.trajectory.tree import build_call_tree

pytestmark = pytest.mark.slow


def bash(command: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": command}}) + "\n</tool_call>"


RULES = [
    {
        "match": "Please solve this issue",
        "emit": "I will write the file. " + bash("printf 'fixed\\n' > answer.txt && cat answer.txt"),
    },
    {
        "match": "fixed",
        "emit": "The file is written; submitting. " + bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"),
    },
]


def test_mini_swe_agent_completes_a_task(tmp_path):
    binary = find_mini_swe_agent()
    if binary is None:
        pytest.skip("mini-swe-agent not installed: run tools/setup.sh")
    engine = start_engine(tmp_path, RULES)
    proxy = start_proxy(tmp_path, [engine.url])
    try:
        key = new_execution(proxy, "mini")
        (tmp_path / "home").mkdir()
        (tmp_path / "ws").mkdir()
        cmd = make_mini_swe_command(
            binary,
            "Write the word fixed into answer.txt.",
            proxy_url=proxy.url,
            model="gyre",
            output=str(tmp_path / "traj.json"),
        )
        env = make_mini_swe_env(os.environ | {"OPENAI_API_KEY": key}, str(tmp_path / "home"))  # the key: never argv
        done = run_harness(cmd, env, str(tmp_path / "ws"), 300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        proxy.stop()
        engine.stop()
    assert (tmp_path / "ws" / "answer.txt").read_text() == "fixed\n"
    traj = json.loads((tmp_path / "traj.json").read_text())
    assert traj["info"]["exit_status"] == "Submitted", traj["info"]
    records, stats = read_records(tmp_path / "records" / "mini.jsonl")
    tree = build_call_tree(records)
    assert len(records) == 2 and tree.nodes[1].parent == 0 and tree.nodes[1].shared >= tree.nodes[0].end
    assert records[1].hints["reused_turns"] == 1 and records[0].hints["api"] == "openai"
