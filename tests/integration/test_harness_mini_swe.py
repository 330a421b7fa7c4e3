"""SLOW (~20 s and ~60 s): real mini-swe-agent (PyPI) through the proxy's OpenAI API and builtin
engines running a scripted policy: one edits a file with its bash tool and submits; four others
finish a 6-call task while drains move their calls between engines."""

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
    {"match": "Please solve this issue", "emit": "I will write the file. " + bash("printf 'fixed\\n' > answer.txt && cat answer.txt")},
    {"match": "fixed", "emit": "The file is written; submitting. " + bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")},
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
        cmd = make_mini_swe_command(binary, "Write the word fixed into answer.txt.", proxy_url=proxy.url, api_key=key,
                                    model="gyre", output=str(tmp_path / "traj.json"))  # fmt: skip
        done = run_harness(cmd, make_mini_swe_env(dict(os.environ), str(tmp_path / "home")), str(tmp_path / "ws"), 300)
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


FILLER = "Checking the output before the next step; " * 3
STEP_RULES = [{"match": "Please solve this issue", "emit": FILLER + bash("echo STEP1-OUT")}]
STEP_RULES += [{"match": f"STEP{i}-OUT", "emit": FILLER + bash(f"echo STEP{i + 1}-OUT")} for i in range(1, 5)]
STEP_RULES += [{"match": "STEP5-OUT", "emit": "Done. " + bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")}]


NUM_AGENTS, NUM_DRAINS = 4, 8
"""Each mini-swe-agent process costs ~7 s of CPU to start (litellm): the 16-session, 20-drain
check runs with API-level sessions in test_proxy.py; this one proves real harnesses see no error."""


def test_mini_swe_agents_see_no_error_through_drains(tmp_path):
    """Real harness processes, 6 calls each, while drains move their calls between 3 engines."""
    import subprocess
    import time
    from concurrent.futures import ThreadPoolExecutor

    from proxy_fixtures import http

    binary = find_mini_swe_agent()
    if binary is None:
        pytest.skip("mini-swe-agent not installed: run tools/setup.sh")
    with ThreadPoolExecutor(3) as pool:
        engines = list(pool.map(lambda i: start_engine(tmp_path, STEP_RULES, name=f"e{i}"), range(3)))
    proxy = start_proxy(tmp_path, [e.url for e in engines], max_imbalance=2)
    procs = []
    try:
        for i in range(NUM_AGENTS):
            key = new_execution(proxy, f"m{i}")
            for d in ("home", "ws"):
                (tmp_path / f"{d}{i}").mkdir()
            cmd = make_mini_swe_command(binary, "Print the five step markers.", proxy_url=proxy.url, api_key=key,
                                        model="gyre", output=str(tmp_path / f"traj{i}.json"))  # fmt: skip
            env = make_mini_swe_env(dict(os.environ), str(tmp_path / f"home{i}"))
            procs.append(subprocess.Popen(cmd, env=env, cwd=tmp_path / f"ws{i}", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + 240
        while not any((tmp_path / "records" / f"m{i}.jsonl").stat().st_size for i in range(NUM_AGENTS)):
            assert time.monotonic() < deadline, "no call finished within 240 s"
            time.sleep(0.1)
        aborted = 0
        for n in range(NUM_DRAINS):
            status, out = http(f"{proxy.url}/admin/engines/e{n % 3}/drain", "POST", token=proxy.admin_token)
            assert status == 200, out
            aborted += out["result"]
            time.sleep(0.2)
            assert http(f"{proxy.url}/admin/engines/e{n % 3}/activate", "POST", token=proxy.admin_token)[0] == 200
            time.sleep(0.1)
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), [o[-2000:] for p, o in zip(procs, outputs) if p.returncode]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        proxy.stop()
        for e in engines:
            e.stop()
    rerouted = 0
    for i in range(NUM_AGENTS):
        traj = json.loads((tmp_path / f"traj{i}.json").read_text())
        assert traj["info"]["exit_status"] == "Submitted", (i, traj["info"])
        records, stats = read_records(tmp_path / "records" / f"m{i}.jsonl")
        tree = build_call_tree(records)
        assert len(records) == 6 and not stats.invalid and tree.missing_seqs == []
        for j in range(1, 6):  # one clean chain: each call extends the previous one token for token
            assert tree.nodes[j].parent == j - 1 and tree.nodes[j].shared >= tree.nodes[j - 1].end
        rerouted += sum(r.rerouted for r in records)
    print(f"{NUM_DRAINS} drains aborted {aborted} calls in flight; {rerouted} of {6 * NUM_AGENTS} records rerouted")
    assert aborted > 0 and rerouted > 0
