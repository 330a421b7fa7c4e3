"""SLOW (~20 s each): real mini-swe-agent (PyPI) through the proxy's OpenAI API and a builtin engine
running a scripted policy edits a file with its bash tool and submits; killed mid-step in its
sandbox, it continues its session. (Harnesses under drains: test_harness_drains.py.)"""

import json
import os

import pytest
from proxy_fixtures import new_execution, start_engine, start_proxy
from resume_fixtures import BLOCKING, kill_mid_command_and_resume, resumable_task

from gyre.harness.agents import (
    MINI_SWE_SESSION_FILE,
    find_mini_swe_agent,
    make_mini_swe_command,
    make_mini_swe_env,
    read_mini_swe_session,
    run_harness,
)
from gyre.harness.config import HarnessConfig
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


RESUME_RULES = [  # the second step's command blocks until the test has killed the harness and flagged its return
    {"match": "ANSWER-WRITTEN", "emit": "Submitting. " + bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")},
    {
        "match": "STEP-ONE-DONE",
        "emit": "Now the answer. " + bash(BLOCKING),
    },
    {"match": "MINI-RESUME", "emit": "First a marker. " + bash("echo STEP-ONE-DONE")},
]


def test_mini_swe_agent_killed_mid_step_continues_its_session(tmp_path):
    """The sandbox's mini (Gyre's agent class) is SIGKILLed while its second step's command runs;
    continued (Sandbox.resume) with a torn last line in its session file, it re-sends the history
    of its interrupted call, re-issues that step and submits, in one execution."""
    if find_mini_swe_agent() is None:
        pytest.skip("mini-swe-agent not installed: run tools/setup.sh")
    engine = start_engine(tmp_path, RESUME_RULES)
    proxy = start_proxy(tmp_path, [engine.url])
    cfg = HarnessConfig(kind="mini_swe_agent")
    session, before = None, []

    def tear(first):
        nonlocal session, before
        session = first.home / MINI_SWE_SESSION_FILE
        before = read_mini_swe_session(session)
        assert [m["role"] for m in before] == ["system", "user", "assistant", "tool"]  # the first whole step
        with open(session, "a") as f:
            f.write('[{"role": "assistant", "content": "Now the')  # a write the kill cut short

    try:
        task = resumable_task("MINI-RESUME: write the answer.")
        _, again, result = kill_mid_command_and_resume(tmp_path, task, "mini-c", cfg, proxy, "gyre", tear)
    finally:
        proxy.stop()
        engine.stop()
    assert (result.workspace / "answer.txt").read_text() == "ANSWER-WRITTEN\n"
    traj = json.loads((again.home / "trajectory.json").read_text())
    assert traj["info"]["exit_status"] == "Submitted" and traj["messages"] == read_mini_swe_session(session)
    records = sorted(read_records(tmp_path / "records" / "mini-c.jsonl")[0], key=lambda r: r.seq)
    # step one, step two (killed in its command), step two again after the restart, the submit
    assert len(records) == 4 and records[2].input_ids.tolist() == records[1].input_ids.tolist()
    tree = build_call_tree(records)
    assert tree.nodes[3].parent == 2 and tree.nodes[3].shared >= tree.nodes[2].end
    assert tree.nodes[1].parent == tree.nodes[2].parent == 0  # both continue step one's call
