"""Harbor task folders end to end on bubblewrap: the oracle check, what the agent can and cannot
see, a planted reward, a timed-out run verified on its preserved workspace, and (slow) gyre-train,
with a task in a local image under podman where podman runs (test_harbor_podman.py: the rest of podman)."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from podman_fixtures import IMAGE_SET, local_image

from gyre.coordinator.ledger import read_ledger
from gyre.harness.config import HarnessConfig
from gyre.harness.evaluate import evaluate
from gyre.harness.podman import podman_available
from gyre.harness.sandbox import Sandbox, SandboxError, bwrap_available
from gyre.tasks.harbor import find_task_dirs
from gyre.tasks.taskset import TaskSet

ROOT = Path(__file__).resolve().parents[2]
SET = ROOT / "tests" / "harbor_tasks"
pytestmark = pytest.mark.skipif(not bwrap_available(), reason="Harbor tasks need bubblewrap (tools/setup.sh)")
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gyre.launch.task_cli", *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_oracle_check_passes_the_shipped_set_and_fails_a_task_whose_image_cannot_be_had(tmp_path):
    done = _cli("check", str(SET))
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(line.split("\t")[:2] for line in lines[:-1]) == [
        ["fix-greeting", "ok"],
        ["hello-file", "ok"],
        ["word-count", "ok"],
    ]
    assert json.loads(lines[-1])["passed"] == 3
    img = tmp_path / "needs-image"
    (img / "tests").mkdir(parents=True)
    (img / "task.toml").write_text('[environment]\ndocker_image = "localhost/gyre-no-such-image:0"\n')
    (img / "instruction.md").write_text("anything")
    (img / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    done = _cli("check", str(tmp_path))
    why = (
        "its image cannot be had: podman pull localhost/gyre-no-such-image:0"
        if podman_available()
        else "harness.isolation=podman"
    )
    assert done.returncode == 1 and f"needs-image\tFAIL\ttask 'needs-image': {why}" in done.stdout, done.stdout


# The "agent": looks for the tests (at /tests and in its task folder), plants a reward, writes a wrong answer.
SNOOP = (
    "bash -c 'pwd > seen.txt; ls /tests >> seen.txt 2>&1; ls {task_dir}/tests {task_dir}/solution >> seen.txt 2>&1; "
    "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && echo planted >> seen.txt; "
    "cat /proc/self/cgroup >> seen.txt; echo goodbye > hello.txt; sleep {sleep_s}'"
)


def _run(task, tmp_path: Path, sleep_s: float = 0) -> tuple[Sandbox, object]:
    command = SNOOP.format(task_dir=task.environment.task_dir, sleep_s=sleep_s)
    harness = HarnessConfig(kind="command", command=command, grace_s=0.5)
    sb = Sandbox(task, f"e-{tmp_path.name}", tmp_path, harness, "http://127.0.0.1:9", "key", "gyre")
    sb.prepare()
    sb.start()
    return sb, sb.wait()


def test_agent_never_sees_the_tests_and_a_planted_reward_is_ignored(tmp_path):
    task = TaskSet.load(SET).get("hello-file")
    sb, result = _run(task, tmp_path)
    seen = (result.workspace / "seen.txt").read_text()
    assert result.exit_code == 0 and sb.isolated, result.log_path.read_text()
    assert seen.splitlines()[0] == "/app" and "planted" in seen
    assert seen.count("No such file or directory") == 2, seen  # the folder's tests/ and solution/
    assert seen.splitlines()[3] == "planted", seen  # /tests is empty until the verifier's turn
    assert (result.workspace / "NOTES.md").is_file()  # started from environment/'s files
    cgroup = f"gyre-sandbox-{sb.execution_id}"  # [environment].cpus = 1: the sandbox's own CPU quota
    assert (cgroup in seen) == os.access("/sys/fs/cgroup/cpu", os.W_OK), seen
    ev = evaluate(task, result.workspace, "finished", sb.environment)  # shared: the reward it planted is gone
    sb.close()  # the environment and its CPU quota end together
    assert not Path("/sys/fs/cgroup/cpu", cgroup).exists() and not Path("/sys/fs/cgroup", cgroup).exists()
    assert (ev.outcome, ev.score) == ("finished", 0.0), ev
    (result.workspace / "hello.txt").write_text("hello\n")
    assert evaluate(task, result.workspace, "finished").score == 1.0


def test_timed_out_run_is_verified_on_its_preserved_workspace(tmp_path):
    task = dataclasses.replace(TaskSet.load(SET).get("hello-file"), time_budget_s=1.0)
    sb, result = _run(task, tmp_path, sleep_s=60)
    assert result.timed_out and result.duration_s < 10
    (result.workspace / "hello.txt").write_text("hello")
    ev = evaluate(task, result.workspace, "timed_out", sb.environment)
    sb.close()
    assert (ev.outcome, ev.score) == ("timed_out", 1.0), ev


def test_verifier_without_reward_and_past_its_timeout_is_an_evaluator_error(tmp_path):
    task = TaskSet.load(SET).get("hello-file")
    tests = tmp_path / "task" / "tests"
    tests.mkdir(parents=True)
    env = dataclasses.replace(task.environment, task_dir=str(tmp_path / "task"))
    for script, why in [("exit 0", "no reward file"), ("sleep 30", "past its timeout")]:
        (tests / "test.sh").write_text(script + "\n")
        verifier = dataclasses.replace(task.evaluator, timeout_s=1, tests=(str(tests),))
        quick = dataclasses.replace(task, environment=env, evaluator=verifier)
        ev = evaluate(quick, tmp_path, "finished")
        assert ev.outcome == "evaluator_error" and ev.score is None and why in ev.detail, ev


def test_isolation_none_refuses_a_harbor_task(tmp_path):
    task = TaskSet.load(SET).get("word-count")
    sb = Sandbox(task, "e1", tmp_path, HarnessConfig(isolation="none"), "http://127.0.0.1:9", "key", "gyre")
    with pytest.raises(SandboxError, match="^task 'word-count': harness.isolation"):
        sb.prepare()


@pytest.mark.slow
def test_one_training_step_on_harbor_tasks(tmp_path):
    """Where podman and the local image are at hand, the image task joins the run under isolation=podman."""
    run_dir, (image, _) = tmp_path / "run", local_image()
    tasks, extra = SET, []
    if image is not None:
        tasks = tmp_path / "set"
        tasks.mkdir()
        for d in [*find_task_dirs(SET), IMAGE_SET / "hello-image"]:
            (tasks / d.name).symlink_to(d)
        extra = ["harness.isolation=podman"]
    n_tasks = len(find_task_dirs(tasks))
    cmd = [
        sys.executable,
        "-m",
        "gyre.launch.train",
        f"hydra.run.dir={run_dir}",
        f"tasks.path={tasks}",
        "num_steps=1",
        "coordinator.group_size=2",
        f"coordinator.groups_per_step={n_tasks}",  # one epoch of the draw order: every task once
        "coordinator.sessions_per_cell=20",
        "coordinator.train_tok_s=100",
        "harness.toy.max_tokens=16",
        "harness.toy.max_turns=2",
        "harness.toy.subagent=false",
        "harness.toy.verify=false",
        "trajectory.drop_uniform_groups=false",  # the tiny model solves nothing: train on zero advantages
        *extra,
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "warm start skipped" in done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["executions"].get("trained", 0) >= 1, summary
    assert (run_dir / "checkpoints" / "step_00000001").is_dir()
    view = read_ledger(run_dir / "ledger.jsonl")
    assert not any(k.startswith("excluded/sandbox") or k.endswith("evaluator_error") for k in view.counts()), (
        view.counts()
    )
    ran = {view.history[eid][0].task_id for eid in view.history}
    assert ran == {d.name for d in find_task_dirs(tasks)}, ran
    for eid in view.history:  # hello-file's cpus cgroups are gone with their sandboxes, the containers too
        assert not Path("/sys/fs/cgroup/cpu", f"gyre-sandbox-{eid}").exists()
    if image is not None:
        left = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True)
        assert not [n for n in left.stdout.split() if n.startswith("gyre-") and n[5:] in view.history], left.stdout
