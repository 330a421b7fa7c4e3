"""spawn_child: a child with its log, in its own session when asked, dying with its parent."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from gyre.common.spawn import spawn_child
from gyre.common.wait import wait_until

_PARENT = """
import sys
from gyre.common.spawn import spawn_child
child = spawn_child(["sleep", "600"], sys.argv[1])
print(child.pid, flush=True)
sys.stdin.read()  # until the test kills it
"""


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_child_writes_to_its_log_and_runs_in_child_first_in_its_own_session(tmp_path):
    log, pre = tmp_path / "child.log", tmp_path / "pre"
    log.write_text("before\n")

    def in_child() -> None:
        pre.write_text(str(os.getpid()))

    cmd = [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"]
    proc = spawn_child(cmd, log, own_session=True, in_child=in_child)
    assert os.getpgid(proc.pid) == proc.pid  # its own group, before it exits
    assert proc.wait(timeout=60) == 0
    assert log.read_text().split() == ["before", "out", "err"]  # appended, stderr with stdout
    assert pre.read_text() == str(proc.pid)


def test_the_child_dies_when_its_parent_is_killed(tmp_path):
    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(tmp_path / "sleep.log")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONPATH": str(root)},
    )
    try:
        child = int(parent.stdout.readline())
        assert not _gone(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        assert wait_until(lambda: _gone(child), timeout_s=30), f"child {child} outlived its killed parent"
    finally:
        parent.kill()
        parent.wait()
