"""What an agent can read, in each sandbox kind: its workspace, home and the harness's install; not
its task's tests or evaluator spec, another execution's workspace, the run's records, or /root."""

import json
import resource
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from podman_fixtures import IMAGE_SET, local_image

from gyre.harness.config import HarnessConfig
from gyre.harness.roots import harness_installs
from gyre.harness.sandbox import Sandbox, bwrap_available
from gyre.tasks.taskset import TaskSet

ROOT = Path(__file__).resolve().parents[2]
HARBOR_SET = ROOT / "tests" / "harbor_tasks"
# Each path the agent finds goes to seen.txt, /root's entries to root.txt (no braces: the command is formatted).
PROBE = 'sh -c \'for p in "$@"; do test -e "$p" && echo "$p"; done > seen.txt; ls -A /root > root.txt; exit 0\' probe'
pytestmark = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap cannot run here")


def _run(task, run_dir: Path, probed: list[Path], isolation: str = "auto") -> Sandbox:
    """The probe as the harness of one execution of `task` in `run_dir`, beside a sibling's
    workspace and a records file; returns the ended sandbox."""
    sibling = run_dir / "sandboxes" / "other" / "workspace" / "solution.py"
    records = run_dir / "records" / "other.jsonl"
    for path in (sibling, records):
        path.parent.mkdir(parents=True)
        path.write_text("secret\n")
    command = " ".join([PROBE, *map(str, [*probed, sibling, records, ROOT / "tests", ROOT / "pyproject.toml"])])
    cfg = HarnessConfig(kind="command", command=command, isolation=isolation, grace_s=0.5)
    sb = Sandbox(task, f"e-{uuid.uuid4().hex[:6]}", run_dir / "sandboxes", cfg, "http://127.0.0.1:9", "key", "gyre")
    sb.prepare()
    sb.start()
    result = sb.wait()
    assert result.exit_code == 0 and sb.isolated, result.log_path.read_text()
    return sb


def _assert_hidden(sb: Sandbox, own_root: set[str] = frozenset()) -> None:
    """Nothing probed was seen; /root holds only the way to the harness's own install (here a pyenv
    Python) and `own_root` (an image's own /root), nothing else of the host's."""
    assert (sb.workspace / "seen.txt").read_text() == "", "the agent saw what it must not read"
    allowed = {p.relative_to("/root").parts[0] for p in harness_installs(["sh"]) if p.is_relative_to("/root")}
    seen_root = set((sb.workspace / "root.txt").read_text().split())
    assert seen_root <= allowed | own_root, seen_root - allowed - own_root


def test_json_task_under_bubblewrap_reads_neither_its_spec_nor_the_run(tmp_path):
    task_set = tmp_path / "tasks"
    task_set.mkdir()
    spec = {
        "task_id": "t",
        "instruction": "solve",
        "workspace": {"files": {"a.txt": ""}},
        "evaluator": {"kind": "json_score", "command": "python hidden_check.py"},
        "time_budget_s": 30,
    }
    (task_set / "t.json").write_text(json.dumps(spec))
    (task_set / "hidden_check.py").write_text("print(1.0)\n")
    task = TaskSet.load(task_set).get("t")
    sb = _run(task, tmp_path / "run", [task_set / "t.json", task_set / "hidden_check.py"], isolation="bwrap")
    _assert_hidden(sb)


def test_harbor_task_under_bubblewrap_reads_neither_its_tests_nor_the_run(tmp_path):
    task_dir = tmp_path / "set" / "hello-file"
    shutil.copytree(HARBOR_SET / "hello-file", task_dir)
    task = TaskSet.load(task_dir.parent).get("hello-file")
    probed = [task_dir / "tests" / "test.sh", task_dir / "solution" / "solve.sh", task_dir / "task.toml"]
    sb = _run(task, tmp_path / "run", probed)
    try:
        _assert_hidden(sb)
    finally:
        sb.close()


@pytest.mark.slow
def test_harbor_task_under_podman_reads_neither_its_tests_nor_the_run(tmp_path):
    image, why = local_image()
    if image is None:
        pytest.skip(why)
    task = TaskSet.load(IMAGE_SET).get("hello-image")
    task_dir = Path(task.environment.task_dir)
    probed = [task_dir / "tests", task_dir / "solution", task_dir / "task.toml"]
    sb = _run(task, tmp_path / "run", probed, isolation="podman")
    limits = ["--ulimit", "nofile={}:{}".format(*resource.getrlimit(resource.RLIMIT_NOFILE)), "--ulimit", "nproc=64:64"]
    own = subprocess.run(["podman", "run", "--rm", *limits, image, "ls", "-A", "/root"], capture_output=True, text=True)
    assert own.returncode == 0, own.stderr
    try:
        _assert_hidden(sb, set(own.stdout.split()))
    finally:
        sb.close()
