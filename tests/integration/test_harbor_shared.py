"""Harbor's shared verification, end to end: what an agent (or the oracle) leaves outside the workdir and
the services it leaves running reach the verifier, in bubblewrap and in podman; `environment_mode =
"separate"` verifies in a fresh environment instead; a failing solve.sh leaves the verdict to the verifier;
`gyre-task check` passes the fixture sets (tests/harbor_shared_tasks, tests/harbor_image_shared_tasks)."""

import dataclasses
import http.server
import json
import os
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from podman_fixtures import local_image

from gyre.harness.config import HarnessConfig
from gyre.harness.evaluate import evaluate
from gyre.harness.sandbox import Sandbox, bwrap_available
from gyre.harness.workspace import apply_reference
from gyre.tasks.config import TasksConfig
from gyre.tasks.taskset import TaskSet

ROOT = Path(__file__).resolve().parents[2]
SHARED_SET = ROOT / "tests" / "harbor_shared_tasks"
IMAGE_SET = ROOT / "tests" / "harbor_image_shared_tasks"
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
pytestmark = pytest.mark.skipif(not bwrap_available(), reason="Harbor tasks need bubblewrap (tools/setup.sh)")

# The agent's work, as a shell line: a service that keeps a file fresh, started and left running.
SERVICE = (
    'mkdir -p {dir}; setsid bash -c "while true; do date +%s%N > {dir}/beat; sleep 0.2; done" '
    "> /dev/null 2>&1 < /dev/null & echo $! > {dir}/pid; sleep 0.5"
)


def _check(taskset: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gyre.launch.task_cli", "check", str(taskset)]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def _run_agent(task, tmp_path: Path, command: str, isolation: str = "auto") -> Sandbox:
    cfg = HarnessConfig(kind="command", command=command, isolation=isolation, grace_s=1)
    sb = Sandbox(task, f"e-{tmp_path.name}", tmp_path / "sb", cfg, "http://127.0.0.1:9", "key", "gyre")
    sb.prepare()
    sb.start()
    result = sb.wait()
    assert result.exit_code == 0, result.log_path.read_text()
    return sb


def _verify_shared_and_separate(sb: Sandbox) -> tuple[float, float]:
    task = sb.task
    separate = dataclasses.replace(task, environment=dataclasses.replace(task.environment, verification="separate"))
    try:
        apart = evaluate(separate, sb.workspace, "finished", sb.environment)  # a fresh environment
        shared = evaluate(task, sb.workspace, "finished", sb.environment)
    finally:
        sb.close()
    return shared.score, apart.score


def test_check_passes_the_shared_set_and_logs_a_failing_solve_sh():
    done = _check(SHARED_SET)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(line.split("\t")[:2] for line in lines[:-1]) == [
        ["both-rewards", "ok"],
        ["env-vars", "ok"],
        ["failing-solve", "ok"],
        ["state-outside", "ok"],
    ]
    assert "solution/solve.sh exited 3 (the verifier decides)" in done.stderr, done.stderr
    assert json.loads(lines[-1])["passed"] == 4


def test_bubblewrap_agent_state_and_service_reach_a_shared_verifier_only(tmp_path):
    task = TaskSet.load(SHARED_SET).get("state-outside")
    sb = _run_agent(task, tmp_path, "bash -c " + repr(SERVICE.format(dir="/tmp/service")))
    holder = sb.environment.proc
    assert _verify_shared_and_separate(sb) == (1.0, 0.0)
    assert holder.poll() is not None  # closed: the holder, and the service inside it, are gone


def test_reward_json_decides_over_reward_txt_and_keeps_its_keys_as_metrics(tmp_path):
    """The verifier leaves reward.txt 0 and reward.json's reward 1: Harbor's scalar is reward.json's."""
    task = TaskSet.load(SHARED_SET).get("both-rewards")
    sb = _run_agent(task, tmp_path, "bash -c 'echo ok > a.txt; echo ok > b.txt'")
    try:
        ev = evaluate(task, sb.workspace, "finished", sb.environment)
        txt = (sb.environment.verifier_logs / "reward.txt").read_text().strip()
    finally:
        sb.close()
    assert txt == "0"
    assert (ev.score, ev.metrics) == (1.0, {"tests_passed": 2.0, "tests_total": 2.0}), ev


@pytest.mark.slow
def test_podman_check_and_agent_state_in_the_image_workdir(tmp_path):
    image, why = local_image()
    if image is None:
        pytest.skip(why)
    done = _check(IMAGE_SET)
    assert done.returncode == 0 and done.stdout.startswith("image-workdir\tok\tempty=0.0 reference=1.0"), done.stdout
    task = TaskSet.load(IMAGE_SET).get("image-workdir")
    work = "echo fixed > status.txt; echo fixed > /etc/gyre-fixed; " + SERVICE.format(dir="/var/tmp").replace(
        "/var/tmp/pid", "/var/tmp/beat.pid"
    )
    sb = _run_agent(task, tmp_path, "bash -c " + repr(work), isolation="podman")
    assert sb.task.environment.workdir == "/testbed" and (sb.workspace / "main.py").is_file()
    name = sb.environment.name
    assert _verify_shared_and_separate(sb) == (1.0, 0.0)
    listed = subprocess.run(["podman", "ps", "-a", "-q", "--filter", f"name={name}"], capture_output=True, text=True)
    assert listed.stdout == ""


def test_phase_users_and_the_logs_folders(tmp_path):
    """[agent].user runs the oracle, [verifier].user the verifier; /logs/agent is the agent's to write."""
    folder = tmp_path / "users"
    (folder / "tests").mkdir(parents=True)
    (folder / "solution").mkdir()
    (folder / "task.toml").write_text('[agent]\nuser = "daemon"\n[verifier]\nuser = "nobody"\n')
    (folder / "instruction.md").write_text("say who you are")
    (folder / "solution" / "solve.sh").write_text("id -un > /logs/agent/who; ls /logs > /logs/agent/folders\n")
    (folder / "tests" / "test.sh").write_text(
        '[ "$(cat /logs/agent/who)" = daemon ] && [ "$(id -un)" = nobody ] && [ -d /logs/artifacts ] '
        "&& echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"
    )
    task = TaskSet.load(folder).get("users")
    ws = tmp_path / "ws"
    ws.mkdir()
    env = apply_reference(task, ws)
    try:
        ev = evaluate(task, ws, "finished", env)
        folders = (env.state / "logs" / "agent" / "folders").read_text().split()
    finally:
        env.close()
    assert (ev.score, folders) == (1.0, ["agent", "artifacts", "verifier"]), ev


def test_a_reward_outside_0_1_is_kept_unless_clipping_is_asked(tmp_path):
    folder = tmp_path / "set" / "big"
    (folder / "tests").mkdir(parents=True)
    (folder / "task.toml").write_text("")
    (folder / "instruction.md").write_text("anything")
    (folder / "tests" / "test.sh").write_text("echo 1.5 > /logs/verifier/reward.txt\n")
    kept = TaskSet.load(tmp_path / "set").get("big")
    clipped = TaskSet.load(tmp_path / "set", TasksConfig(clip_reward=True)).get("big")
    ws = tmp_path / "ws"
    ws.mkdir()
    assert evaluate(kept, ws, "finished").score == 1.5
    ev = evaluate(clipped, ws, "finished")
    assert ev.score == 1.0 and "clipped to 1" in ev.detail, ev


class _Pong(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"pong")

    def log_message(self, *args):
        pass


# The "agent" (no braces: the command is formatted): the proxy answers, another host port does not.
NO_NET_AGENT = """import socket, sys, urllib.request
seen = [urllib.request.urlopen(sys.argv[1] + "/ping", timeout=10).read().decode()]
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=2)
    seen.append("reached")
except OSError:
    seen.append("unreachable")
open("seen.txt", "w").write(" ".join(seen))
"""


def test_bubblewrap_agent_without_network_reaches_only_the_proxy(tmp_path):
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pong) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    proxy, other = (s.server_port for s in servers)
    task = TaskSet.load(SHARED_SET).get("both-rewards")
    command = f"{sys.executable} -c {shlex.quote(NO_NET_AGENT)} {{proxy_url}} {other}"
    cfg = HarnessConfig(kind="command", command=command, grace_s=1, agent_network="none")
    sb = Sandbox(task, f"e-{tmp_path.name}", tmp_path / "sb", cfg, f"http://127.0.0.1:{proxy}", "key", "gyre")
    sb.prepare()
    sb.start()
    result = sb.wait()
    sb.close()
    for s in servers:
        s.shutdown()
    assert result.exit_code == 0, result.log_path.read_text()
    assert (result.workspace / "seen.txt").read_text() == "pong unreachable"
