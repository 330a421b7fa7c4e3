"""A harness starts wherever it is installed (a virtualenv under /tmp, hidden by a fresh /tmp before),
and a run whose harness cannot start stops with its error instead of training on nothing."""

import os
import shutil
import sys
from pathlib import Path

import pytest
from test_coordinator import _gyre_train, _taskset

from gyre.coordinator.ledger import read_ledger
from gyre.harness.config import HarnessConfig
from gyre.harness.evaluate import evaluate
from gyre.harness.sandbox import Sandbox, bwrap_available
from gyre.tasks.taskset import TaskSet

ROOT = Path(__file__).resolve().parents[2]
AGENT = "#!{python}\nimport pathlib\npathlib.Path('hello.txt').write_text('hello\\n')\n"


@pytest.mark.skipif(not bwrap_available(), reason="Harbor tasks need bubblewrap (tools/setup.sh)")
def test_a_harness_installed_under_tmp_starts_in_a_harbor_task(tmp_path):
    venv = tmp_path / "venv" / "bin"  # under /tmp, as a clone in /tmp or node-local scratch
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(os.path.realpath(sys.executable))
    (venv / "agent").write_text(AGENT.format(python=venv / "python"))
    (venv / "agent").chmod(0o755)
    shutil.copytree(ROOT / "tests" / "harbor_tasks" / "hello-file", tmp_path / "set" / "hello-file")
    task = TaskSet.load(tmp_path / "set").get("hello-file")
    cfg = HarnessConfig(kind="command", command=str(venv / "agent"), grace_s=0.5)
    sb = Sandbox(task, "e-tmp", tmp_path / "run", cfg, "http://127.0.0.1:9", "key", "gyre")
    sb.prepare()
    sb.start()
    result = sb.wait()
    try:
        assert result.exit_code == 0, result.log_path.read_text()
        assert evaluate(task, result.workspace, "finished", sb.environment).score == 1.0
    finally:
        sb.close()


@pytest.mark.slow
def test_a_run_whose_harness_cannot_start_stops_with_its_error(tmp_path):
    tasks = _taskset(tmp_path, ("apple", "river"))
    command = "sh -c 'echo mini: error while loading shared libraries: libgone.so >&2; exit 127'"
    run_dir = tmp_path / "run"
    proc = _gyre_train(
        run_dir,
        tasks,
        "num_steps=10",
        "coordinator.groups_per_step=1",
        "harness=command",
        f'harness.command="{command}"',
    )
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0, out[-3000:]
    assert "harness.kind=command: the first 2 executions all ended without a model call (harness_failed)" in out
    assert "ends: mini: error while loading shared libraries: libgone.so" in out, out[-3000:]
    view = read_ledger(run_dir / "ledger.jsonl")
    reasons = [o.reason for eid in view.history if (o := view.outcome(eid)) is not None]
    assert 2 <= reasons.count("harness_failed") <= 6, reasons  # the first group's, and those the staleness let start
    assert not any(e.state == "trained" for es in view.history.values() for e in es)
