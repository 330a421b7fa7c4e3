"""Harbor multi-step tasks ([[steps]]) end to end on bubblewrap: `gyre-task check` runs each step's oracle
then its verifier (tests/harbor_step_tasks), a harness runs step after step in one environment with each
step's instruction, each step verified after it (also through `gyre-task run`), and a step below its
min_reward stops the rest."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.harness.config import HarnessConfig
from gyre.harness.sandbox import Sandbox, bwrap_available
from gyre.harness.steps import wait_steps
from gyre.launch.task_cli import main
from gyre.tasks.taskset import TaskSet

ROOT = Path(__file__).resolve().parents[2]
SET = ROOT / "tests" / "harbor_step_tasks"
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
pytestmark = pytest.mark.skipif(not bwrap_available(), reason="Harbor tasks need bubblewrap (tools/setup.sh)")

# The "agent": its step's instruction ($0) decides its work; each start leaves a line in starts.txt.
AGENT = (
    'bash -c \'echo "$0" | head -c 11 >> starts.txt; echo >> starts.txt; case "$0" in '
    "First*) echo one > notes.txt; echo created > /tmp/created-mark;; Second*) echo two >> notes.txt;; esac' "
    "{instruction}"
)
WRONG_AGENT = "bash -c 'echo start >> starts.txt; echo zero > notes.txt'"


def _run(tmp_path: Path, command: str):
    task = TaskSet.load(SET).get("two-steps")
    cfg = HarnessConfig(kind="command", command=command, grace_s=1)
    sb = Sandbox(task, f"e-{tmp_path.name}", tmp_path / "sb", cfg, "http://127.0.0.1:9", "key", "gyre")
    sb.prepare()
    sb.start()
    try:
        result, evaluation = wait_steps(sb)
    finally:
        sb.close()
    return sb, result, evaluation


def test_check_runs_each_steps_oracle_then_its_verifier():
    cmd = [sys.executable, "-m", "gyre.launch.task_cli", "check", str(SET)]
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines[0].startswith("two-steps\tok\tempty=0.0 reference=1.0"), lines
    assert json.loads(lines[-1])["passed"] == 1


def test_steps_run_in_turn_in_one_environment_each_verified_after_its_agent(tmp_path):
    sb, result, ev = _run(tmp_path, AGENT)
    assert (ev.outcome, ev.score) == ("finished", 1.0), ev
    assert ev.metrics == {  # mean over the steps of each key (a key a step lacks counts 0), and each step's own
        "lines": 1.0,
        "same_environment": 0.5,
        "steps.create.reward": 1.0,
        "steps.extend.reward": 1.0,
        "steps.extend.lines": 2.0,
        "steps.extend.same_environment": 1.0,
    }
    assert (result.workspace / "starts.txt").read_text().splitlines() == ["First step:", "Second step"]
    assert sb.step == 1 and result.exit_code == 0


def test_a_step_below_its_min_reward_stops_the_rest(tmp_path):
    sb, result, ev = _run(tmp_path, WRONG_AGENT)
    assert (ev.outcome, ev.score) == ("finished", 0.0), ev
    assert "stopped: step 'create': reward=0 is below its min_reward 1" in ev.detail
    assert ev.metrics == {"steps.create.reward": 0.0}
    assert (result.workspace / "starts.txt").read_text() == "start\n"  # the extend step's harness never started
    assert sb.step == 0


def test_gyre_task_run_runs_the_steps_and_reports_their_rewards(tmp_path, capsys):
    """`gyre-task run` on the task folder: the steps in turn, their evaluation reported as gyre-train's."""
    records = tmp_path / "records.jsonl"
    records.write_text("{}\n")  # a model call was made: the execution is scored
    run = ["run", str(SET / "two-steps"), "--harness", "command", "--root", str(tmp_path), "--command", AGENT]
    with pytest.raises(SystemExit) as done:  # in process, against a given proxy: no engine of its own
        main([*run, "--proxy", "http://127.0.0.1:9", "--key", "k", "--records", str(records)])
    assert done.value.code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["outcome"], out["reason"], out["score"]) == ("finished", None, 1.0), out
    assert out["metrics"]["steps.extend.same_environment"] == 1.0 and out["detail"].startswith("mean of 2 steps")
