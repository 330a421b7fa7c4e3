"""Evaluators on good and bad workspaces, and sandboxes: budget kill, isolation, environment."""

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from gyre.harness import sandbox
from gyre.harness.config import HarnessConfig
from gyre.harness.evaluate import evaluate
from gyre.harness.sandbox import Sandbox, SandboxError, bwrap_available
from gyre.harness.workspace import WorkspaceError, apply_reference, make_workspace, run_setup
from gyre.tasks.spec import parse_task
from gyre.tasks.taskset import toy_taskset

PYTEST_WS = {
    "calc.py": "def add(a, b):\n    return a - b\n",
    "tests/test_calc.py": "from calc import add\n\ndef test_zero():\n    assert add(0, 0) == 0\n\n"
    "def test_two():\n    assert add(1, 1) == 2\n",
}


def task_of(evaluator: dict, files: dict | None = None, budget_s: float = 30, **kw):
    spec = {
        "task_id": "t",
        "instruction": "solve",
        "workspace": {"files": files or {"a.txt": ""}},
        "setup": None,
        "evaluator": evaluator,
        "time_budget_s": budget_s,
        **kw,
    }
    return parse_task(spec, "test", Path.cwd())


def workspace_of(task, tmp_path, name="ws"):
    return make_workspace(task.workspace, tmp_path / name)


def test_pytest_evaluator_pass_fraction(tmp_path):
    task = task_of(
        {"kind": "pytest", "command": "{python} -m pytest -q tests"},
        PYTEST_WS,
        reference={"files": {"calc.py": "def add(a, b):\n    return a + b\n"}},
    )
    ws = workspace_of(task, tmp_path)
    assert (evaluate(task, ws, "finished").outcome, evaluate(task, ws, "finished").score) == ("finished", 0.5)
    apply_reference(task, ws)
    assert evaluate(task, ws, "timed_out").score == 1.0
    (ws / "tests/test_calc.py").unlink()  # the task's own tests gone: no test ran
    e = evaluate(task, ws, "finished")
    assert e.outcome == "evaluator_error" and "did not run" in e.detail


def test_json_score_evaluator_good_garbage_crash_hang(tmp_path):
    toy = toy_taskset().tasks[0]
    ws = workspace_of(toy, tmp_path)
    assert evaluate(toy, ws, "finished").score == 0.0  # nothing written: a real zero
    (ws / "answer.txt").write_text("appel")
    assert 0.2 < evaluate(toy, ws, "finished").score < 1.0  # near miss: partial credit
    apply_reference(toy, ws)
    assert evaluate(toy, ws, "finished").score == 1.0
    cases = {
        "garbage": "echo 'score: high'",
        "out-of-range": "echo 1.5",
        "crash": "exit 3",
        "hang": "sleep 30",
        "script-missing": "{python} {workspace}/check.py",
        "flaky-toy": "{python} {pkg}/tasks/toy/check.py answer.txt apple --fail-rate 1",
    }
    for name, cmd in cases.items():
        task = task_of({"kind": "json_score", "command": cmd, "timeout_s": 0.5})
        e = evaluate(task, workspace_of(task, tmp_path, name), "finished")
        assert (e.outcome, e.score) == ("evaluator_error", None), name
    assert (
        "timeout"
        in evaluate(task_of({"kind": "json_score", "command": "sleep 30", "timeout_s": 0.3}), ws, "finished").detail
    )


def test_a_timed_out_run_without_a_valid_reward_is_budget_exhausted_not_an_evaluator_error(tmp_path):
    task = task_of({"kind": "json_score", "command": "echo 'score: high'", "timeout_s": 5})
    ws = workspace_of(task, tmp_path)
    assert (evaluate(task, ws, "finished").outcome, evaluate(task, ws, "timed_out").outcome) == (
        "evaluator_error",
        "budget_exhausted",
    )
    good = task_of({"kind": "json_score", "command": "echo 0.5", "timeout_s": 5})
    assert (evaluate(good, workspace_of(good, tmp_path, "good"), "timed_out").outcome) == "timed_out"  # partial credit
    nothing = task_of({"kind": "json_score", "command": "echo 0", "timeout_s": 5})  # no credit: no valid reward
    ws = workspace_of(nothing, tmp_path, "nothing")
    assert [(e.outcome, e.score) for e in (evaluate(nothing, ws, "finished"), evaluate(nothing, ws, "timed_out"))] == [
        ("finished", 0.0),
        ("budget_exhausted", None),
    ]


def test_files_evaluator_and_missing_workspace(tmp_path):
    task = task_of({"kind": "files", "files": {"a.txt": "one", "b.txt": "two"}})
    ws = workspace_of(task, tmp_path)
    assert evaluate(task, ws, "finished").score == 0.0  # a.txt empty, b.txt missing
    (ws / "a.txt").write_text("one\n")
    assert evaluate(task, ws, "finished").score == 0.5
    (ws / "b.txt").write_text("two")
    assert (evaluate(task, ws, "finished").outcome, evaluate(task, ws, "finished").score) == ("finished", 1.0)
    e = evaluate(task, tmp_path / "gone", "finished")
    assert e.outcome == "evaluator_error" and "missing" in e.detail


def run_sandbox(
    tmp_path, command: str, budget_s: float = 30, isolation: str = "auto", grace_s: float = 0.5, evaluator=None
):
    task = task_of(evaluator or {"kind": "files", "files": {"answer.txt": "apple"}}, budget_s=budget_s)
    sb = Sandbox(
        task,
        f"ex-{uuid.uuid4().hex[:6]}",
        tmp_path / "sandboxes",
        HarnessConfig(kind="command", command=command, isolation=isolation, grace_s=grace_s),
        "http://127.0.0.1:9",
        "key-123",
        "tiny",
    )
    sb.prepare()
    sb.start()
    return task, sb, sb.wait()


@pytest.mark.parametrize(
    "trap,isolation,min_s",
    [
        pytest.param("", "auto", 1.0, id="sigterm"),
        pytest.param("trap '' TERM; ", "none", 1.5, id="sigkill-after-grace"),
    ],
)
def test_budget_kill_is_timed_out_with_workspace_score(tmp_path, trap, isolation, min_s):
    marker = f"60.{uuid.uuid4().int % 10**9:09d}"  # the harness's sleeps, found by their argument in /proc
    cmd = f'sh -c "{trap}echo apple > answer.txt; echo started; sleep {marker} & sleep {marker}"'
    task, sb, r = run_sandbox(tmp_path, cmd, budget_s=1.0, isolation=isolation, grace_s=0.5)
    assert r.timed_out and r.exit_code == (-9 if trap else r.exit_code) and r.exit_code != 0
    assert min_s <= r.duration_s < 10  # a harness ignoring SIGTERM lasts the grace longer
    assert evaluate(task, r.workspace, "timed_out").score == 1.0
    assert "started" in r.log_path.read_text()
    deadline = time.monotonic() + 5  # SIGKILL is delivered asynchronously
    while (left := processes_running(f"sleep\0{marker}\0")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, "the background sleep outlived its process group"


def processes_running(cmdline: str) -> list[str]:
    """PIDs whose command line (NUL-separated) contains `cmdline`; zombies have none."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if cmdline.encode() in (proc / "cmdline").read_bytes():
                found.append(proc.name)
        except OSError:
            pass
    return found


def test_environment_carries_proxy_key_and_model_and_limits(tmp_path):
    _, _, r = run_sandbox(
        tmp_path,
        "bash -c 'echo $GYRE_PROXY_URL $GYRE_API_KEY {model} $OPENAI_BASE_URL $(ulimit -t -v -u | "
        'sed "s/.* //") > env.txt\'',
    )
    assert (r.exit_code, r.timed_out) == (0, False), r.log_path.read_text()
    cfg = HarnessConfig()
    assert (r.workspace / "env.txt").read_text().split() == [
        "http://127.0.0.1:9",
        "key-123",
        "tiny",
        "http://127.0.0.1:9/v1",
        str(cfg.cpu_limit_s),
        str(int(cfg.mem_limit_gb * 2**20)),
        str(cfg.max_processes),
    ]


@pytest.mark.skipif(not bwrap_available(), reason="bubblewrap cannot run here")
def test_writes_outside_the_workspace_fail_under_bubblewrap(tmp_path):
    outside = [
        Path("/tmp") / f"gyre-escape-{uuid.uuid4().hex}",
        Path(os.path.expanduser("~")) / f"gyre-escape-{uuid.uuid4().hex}",
    ]
    cmd = (
        f"sh -c 'echo in > inside.txt; echo x > ../escape.txt; echo y > {outside[0]}; echo z > {outside[1]}; "
        f"echo h > $HOME/private.txt; exit 0'"
    )
    _, sb, r = run_sandbox(tmp_path, cmd, isolation="bwrap")
    assert sb.isolated and r.exit_code == 0
    assert (r.workspace / "inside.txt").read_text() == "in\n"
    assert not (r.workspace.parent / "escape.txt").exists() and not any(p.exists() for p in outside)
    assert (sb.home / "private.txt").exists()  # the private HOME is writable, the real one is not
    # ../ and /tmp lie in the sandbox's own fresh /tmp here (gone with it); the root is read-only
    assert r.log_path.read_text().count("Read-only file system") == 1


def test_plain_runner_without_isolation(tmp_path):
    _, sb, r = run_sandbox(
        tmp_path, f"{sys.executable} -c \"open('answer.txt', 'w').write('apple')\"", isolation="none"
    )
    assert not sb.isolated and r.exit_code == 0 and (r.workspace / "answer.txt").read_text() == "apple"


def test_without_bubblewrap_auto_warns_once_and_runs_plain(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "_bwrap_ok", None)
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger=sandbox.__name__):
        assert not bwrap_available() and not bwrap_available()
        _, sb, r = run_sandbox(tmp_path, "sh -c 'echo apple > answer.txt'", isolation="auto")
    assert sum("bubblewrap (bwrap) cannot run here" in rec.message for rec in caplog.records) == 1  # said once
    assert not sb.isolated and r.exit_code == 0 and (r.workspace / "answer.txt").read_text() == "apple\n"
    with pytest.raises(SandboxError, match="isolation=bwrap but bubblewrap cannot run"):
        run_sandbox(tmp_path, "true", isolation="bwrap")


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def test_workspace_sources_dir_tar_git_commit_and_setup(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.txt").write_text("one")
    with tarfile.open(tmp_path / "ws.tar.gz", "w:gz") as tar:
        tar.add(src / "pkg", arcname="pkg")
    repo = tmp_path / "repo"
    shutil.copytree(src, repo)
    git("init", "-q", cwd=repo)
    git("add", "-A", cwd=repo)
    git("commit", "-qm", "one", cwd=repo)
    commit = git("rev-parse", "HEAD", cwd=repo)
    (repo / "pkg" / "a.txt").write_text("two")  # a later commit the task must not see
    git("commit", "-qam", "two", cwd=repo)
    sources = {"dir": {"dir": "src"}, "tar": {"tar": "ws.tar.gz"}, "git": {"git": "repo", "commit": commit}}
    for name, source in sources.items():
        spec = {
            "task_id": name,
            "instruction": "x",
            "workspace": source,
            "setup": "cp pkg/a.txt copied.txt",
            "evaluator": {"kind": "files", "files": {"copied.txt": "one"}},
            "time_budget_s": 5,
        }
        task = parse_task(spec, "test", tmp_path)  # relative sources: relative to the task set's directory
        ws = make_workspace(task.workspace, tmp_path / "ws" / name)
        run_setup(task, ws)
        assert evaluate(task, ws, "finished").score == 1.0, name
    with pytest.raises(WorkspaceError, match="exists already"):
        make_workspace(task.workspace, ws)
    with pytest.raises(WorkspaceError, match="setup exited 4"):
        run_setup(dataclasses.replace(task, setup="exit 4"), ws)
    with pytest.raises(WorkspaceError, match="git checkout"):
        make_workspace(dataclasses.replace(task.workspace, commit="0" * 40), tmp_path / "ws" / "bad-commit")
