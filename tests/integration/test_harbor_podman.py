"""SLOW: Harbor tasks with an image under harness.isolation=podman, on a local Debian image (no registry):
the oracle check builds the task's Dockerfile and scores in it; the agent's container reaches the proxy
and nothing else, never sees the tests, and its planted reward is ignored; a container past its budget
is stopped and removed. (A 1-step gyre-train: test_harbor_bwrap.py folds this set into its run.)"""

import dataclasses
import http.server
import json
import os
import shlex
import subprocess
import sys
import threading

import pytest
from podman_fixtures import IMAGE_SET, ROOT, local_image

from gyre.harness.config import HarnessConfig
from gyre.harness.evaluate import evaluate
from gyre.harness.sandbox import Sandbox
from gyre.tasks.taskset import TaskSet

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def task():
    image, why = local_image()
    if image is None:
        pytest.skip(why)
    return TaskSet.load(IMAGE_SET).get("hello-image")


def test_oracle_check_builds_the_image_and_scores_in_it(task):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "gyre.launch.task_cli", "check", str(IMAGE_SET)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("hello-image\tok\tempty=0.0 reference=1.0"), done.stdout
    assert json.loads(done.stdout.strip().splitlines()[-1])["passed"] == 1


# The "agent", run by the host's Python inside the container (no braces: the command is formatted):
# what it can reach and see; it plants a reward and writes a wrong answer.
AGENT = """import os, socket, sys, urllib.request
seen = [os.getcwd(), urllib.request.urlopen(sys.argv[1] + "/ping", timeout=10).read().decode()]
for host, port in (("10.0.2.2", 80), ("1.1.1.1", 53)):
    try:
        socket.create_connection((host, port), timeout=2)
        seen.append("reached " + host)
    except OSError:
        seen.append("unreachable")
hidden = ("/tests", sys.argv[2] + "/tests", sys.argv[2] + "/solution")
seen += [str(os.path.exists(p) and bool(os.listdir(p))) for p in hidden]
os.makedirs("/logs/verifier", exist_ok=True)
open("/logs/verifier/reward.txt", "w").write("1")
open("hello.txt", "w").write("goodbye")
open("seen.txt", "w").write("\\n".join(seen))
"""


class Pong(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"pong")

    def log_message(self, *args):
        pass


def _sandbox(task, tmp_path, command: str) -> Sandbox:
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pong)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    cfg = HarnessConfig(kind="command", command=command, isolation="podman", grace_s=1, agent_network="none")
    url = f"http://127.0.0.1:{proxy.server_port}"
    sb = Sandbox(task, f"e-{tmp_path.name}", tmp_path / "sb", cfg, url, "key", "gyre")
    sb.prepare()
    sb.start()
    return sb


def _containers(name: str) -> str:
    return subprocess.run(
        ["podman", "ps", "-a", "-q", "--filter", f"name={name}"], capture_output=True, text=True
    ).stdout


def test_agent_reaches_only_the_proxy_never_sees_the_tests_and_its_planted_reward_is_ignored(task, tmp_path):
    sb = _sandbox(task, tmp_path, f"{sys.executable} -c {shlex.quote(AGENT)} {{proxy_url}} {task.environment.task_dir}")
    result = sb.wait()
    assert result.exit_code == 0 and sb.isolated, result.log_path.read_text()
    seen = (result.workspace / "seen.txt").read_text().splitlines()
    assert seen == ["/app", "pong", "unreachable", "unreachable", "False", "False", "False"]
    assert (result.workspace / "NOTES.md").read_text() == "The image put this file here.\n"  # the image's workdir
    ev = evaluate(task, result.workspace, "finished", sb.environment)  # in the agent's container: no planted reward
    assert (ev.outcome, ev.score) == ("finished", 0.0), ev
    (result.workspace / "hello.txt").write_text("hello\n")
    assert evaluate(task, result.workspace, "finished", sb.environment).score == 1.0
    sb.close()
    assert _containers(sb.environment.name) == ""


def test_a_container_past_its_budget_is_stopped_and_removed(task, tmp_path):
    short = dataclasses.replace(task, time_budget_s=2.0)
    sb = _sandbox(short, tmp_path, "bash -c 'echo hello > hello.txt; trap \"\" TERM; sleep 60'")
    result = sb.wait()
    assert result.timed_out and result.duration_s < 20, result
    ps = ["podman", "exec", sb.environment.name, "sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"]
    left = subprocess.run(ps, capture_output=True, text=True).stdout
    assert "sleep 60" not in left and "relay" not in left, left  # what it ran inside was killed at the budget
    ev = evaluate(short, result.workspace, "timed_out", sb.environment)  # verified on its preserved workspace
    assert (ev.outcome, ev.score) == ("timed_out", 1.0), ev
    sb.close()
    assert _containers(sb.environment.name) == ""
