"""Fresh workspace copies from a task's source, and reference solutions applied to them (filesystem edge)."""

import logging
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

from gyre.errors import GyreError
from gyre.harness.environment import BaseTaskEnv, open_environment
from gyre.tasks.spec import Task, WorkspaceSource

log = logging.getLogger(__name__)


class WorkspaceError(GyreError):
    """A workspace that could not be made (source gone, git/tar failure, setup failed)."""


def _write_files(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _git(args: list[str], cwd: Path) -> None:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise WorkspaceError(f"git {' '.join(args)} failed: {done.stderr.strip()[-500:]}")


def make_workspace(source: WorkspaceSource, dest: Path) -> Path:
    """Materialise `source` into the new directory `dest` (which must not exist yet).

    Raises:
        WorkspaceError: the source cannot be copied, cloned or unpacked.
    """
    dest = Path(dest)
    if dest.exists():
        raise WorkspaceError(f"{dest} exists already; each execution gets a fresh workspace")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        if source.kind == "dir":
            shutil.copytree(source.location, dest, symlinks=True)
        elif source.kind == "files":
            dest.mkdir()
            _write_files(dest, source.files)
        elif source.kind == "tar":
            dest.mkdir()
            with tarfile.open(source.location) as tar:
                tar.extractall(dest, filter="data")
        else:
            _git(["clone", "--quiet", "--no-checkout", source.location, str(dest)], dest.parent)
            _git(["checkout", "--quiet", "--detach", source.commit], dest)
    except (OSError, tarfile.TarError) as e:
        raise WorkspaceError(f"cannot make a workspace from {source.kind} {source.location or ''}: {e}") from e
    return dest


def run_setup(task: Task, workspace: Path, timeout_s: float = 600.0) -> None:
    """Run the task's setup command in the workspace.

    Raises:
        WorkspaceError: it failed or ran past `timeout_s` (the output tail says why).
    """
    if not task.setup:
        return
    try:
        done = subprocess.run(task.setup, shell=True, cwd=workspace, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise WorkspaceError(f"task {task.task_id!r}: setup ran past {timeout_s} s") from None
    if done.returncode != 0:
        raise WorkspaceError(
            f"task {task.task_id!r}: setup exited {done.returncode}: {(done.stdout + done.stderr)[-500:]}"
        )


def apply_reference(task: Task, workspace: Path, timeout_s: float = 600.0) -> BaseTaskEnv | None:
    """Put the task's reference solution into the workspace; a Harbor task's oracle runs in an
    environment returned for its verifier (evaluate(..., environment=it); the caller closes it).

    Raises:
        WorkspaceError: the task has no reference, or its command failed.
    """
    if task.reference is None:
        raise WorkspaceError(f"task {task.task_id!r} has no reference solution")
    if "files" in task.reference:
        _write_files(workspace, task.reference["files"])
        return None
    if "solve_sh" in task.reference:
        return run_solve_sh(task, workspace)
    done = subprocess.run(
        task.reference["command"], shell=True, cwd=workspace, capture_output=True, text=True, timeout=timeout_s
    )
    if done.returncode != 0:
        raise WorkspaceError(f"task {task.task_id!r}: reference command exited {done.returncode}: {done.stderr[-500:]}")
    return None


def run_solve_sh(task: Task, workspace: Path) -> BaseTaskEnv:
    """Harbor's oracle in a new environment of the task's (`solve_in`), returned for the verifier.

    Raises:
        WorkspaceError: its environment could not start, or solve.sh could not (naming the task).
    """
    try:
        env = open_environment(task, workspace, task.environment.agent_network)
    except GyreError as e:
        raise WorkspaceError(f"task {task.task_id!r}: the oracle's environment: {e}") from e
    try:
        solve_in(env, task)
    except WorkspaceError:
        env.close()
        raise
    return env


def solve_in(env: BaseTaskEnv, task: Task) -> None:
    """Harbor's oracle: `bash /solution/solve.sh` from the workdir, in the task's environment `env` (as the
    agent would run: its network, `[agent].user`, `[environment].env` and `[solution].env`) with a copy
    of the reference's solution/ at /solution, under the agent's time budget. Its exit status is logged,
    not judged: the verifier decides, as in Harbor (its oracle agent, src/harbor/agents/oracle.py, raises
    nothing on a failing solve.sh).

    Raises:
        WorkspaceError: solve.sh could not start (naming the task).
    """
    contract = task.environment
    env.put("/solution", Path(task.reference["solve_sh"]).parent)
    host_env = {**os.environ, "HOME": str(env.home)} if env.backend == "bwrap" else None
    argv = env.enter(["bash", "/solution/solve.sh"], {**contract.env, **contract.solution_env}, contract.agent_user)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=task.time_budget_s, env=host_env)
        log.info("task %s: solution/solve.sh exited %d", task.task_id, done.returncode)
        if done.returncode != 0:
            log.warning(
                "task %s: solution/solve.sh exited %d (the verifier decides): %s",
                task.task_id,
                done.returncode,
                (done.stdout + done.stderr)[-300:],
            )
    except subprocess.TimeoutExpired:
        log.warning("task %s: solution/solve.sh ran past %g s (the verifier decides)", task.task_id, task.time_budget_s)
        env.kill_all()
    except OSError as e:
        raise WorkspaceError(f"task {task.task_id!r}: cannot start solve.sh: {e}") from e
