"""Starting a child process: its output appended to a log file, and dying with its parent (Linux
prctl PR_SET_PDEATHSIG: SIGTERM when the parent dies, even by SIGKILL), so a killed coordinator
leaves no cell, engine, rank or proxy worker behind. The "parent" is the thread that forked: spawn
long-lived children from a thread that lives as long."""

import ctypes
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path


def _die_with_parent(then: Callable[[], None] | None) -> Callable[[], None]:
    """The child's `preexec_fn`: ask for SIGTERM when the parent dies, then run `then`."""

    def in_child() -> None:
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if then is not None:
            then()

    return in_child


def spawn_child(
    cmd: list[str],
    log_path: str | os.PathLike,
    *,
    env: dict[str, str] | None = None,
    own_session: bool = False,
    in_child: Callable[[], None] | None = None,
) -> subprocess.Popen:
    """Start `cmd`, its stdout and stderr appended to `log_path`, dying with its parent.

    Args:
        env: its environment (default: this process's).
        own_session: in a session (and process group) of its own, so that it and what it starts
            can be signalled as one (`os.killpg`), apart from its parent's group.
        in_child: run in the child before exec (after the death signal is set): joining a CPU
            quota, say, so that whatever it starts is in it too.

    Returns:
        The child's Popen.
    """
    with open(Path(log_path), "ab") as log:
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=own_session,
            preexec_fn=_die_with_parent(in_child),
        )
