"""`gyre-task`: check on the embedded toy set, list, and run with the command harness (own engine and proxy)."""

import json
import subprocess
import sys
from importlib import resources


def gyre_task(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gyre.tasks.cli", *args], capture_output=True, text=True, timeout=300)


def test_check_and_list(tmp_path):
    ids = [line.split("\t")[0] for line in gyre_task("list").stdout.splitlines()]
    assert len(ids) == 16 and ids[0] == "word-apple"  # the embedded toy set
    lines = (resources.files("gyre") / "tasks/toy/tasks.jsonl").read_text().splitlines()[:2]
    (tmp_path / "two.jsonl").write_text("\n".join(lines) + "\n")
    done = gyre_task("check", str(tmp_path / "two.jsonl"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["passed"] == 2
    broken = json.loads(lines[0]) | {"reference": {"files": {"answer.txt": "wrong"}}}
    (tmp_path / "broken.jsonl").write_text(json.dumps(broken) + "\n")
    done = gyre_task("check", str(tmp_path / "broken.jsonl"))
    assert done.returncode == 1 and "word-apple\tFAIL" in done.stdout


def test_run_command_harness_with_own_engine_and_proxy(tmp_path):
    done = gyre_task("run", "word-river", "--harness", "command", "--root", str(tmp_path),
                     "--command", "sh -c 'echo rivers > answer.txt; echo {model}'")  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["outcome"] == "finished" and 0.2 < out["score"] < 1.0  # a near miss: partial credit
    assert out["workspace"].startswith(str(tmp_path)) and out["records_path"].endswith(".jsonl") and out["duration_s"] > 0
