"""Fresh workspace copies from a task's source, and reference solutions applied to them (filesystem edge)."""

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from gyre.errors import GyreError
from gyre.harness.contract import Mount, list_host_root, make_contract_prefix
from gyre.harness.podman import ensure_image, make_run_argv, remove
from gyre.tasks.spec import Task, WorkspaceSource


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


def apply_reference(task: Task, workspace: Path, timeout_s: float = 600.0) -> None:
    """Put the task's reference solution into the workspace.

    Raises:
        WorkspaceError: the task has no reference, or its command failed.
    """
    if task.reference is None:
        raise WorkspaceError(f"task {task.task_id!r} has no reference solution")
    if "files" in task.reference:
        _write_files(workspace, task.reference["files"])
        return
    if "solve_sh" in task.reference:
        run_solve_sh(task, workspace)
        return
    done = subprocess.run(
        task.reference["command"], shell=True, cwd=workspace, capture_output=True, text=True, timeout=timeout_s
    )
    if done.returncode != 0:
        raise WorkspaceError(f"task {task.task_id!r}: reference command exited {done.returncode}: {done.stderr[-500:]}")


def run_solve_sh(task: Task, workspace: Path) -> None:
    """Harbor's oracle: `bash /solution/solve.sh` from the workdir, in the agent's sandbox layout
    (bubblewrap, or the task's image with podman) with a copy of solution/ at /solution, under the
    agent's time budget.

    Raises:
        WorkspaceError: it failed, ran past the budget, or its sandbox could not start.
    """
    contract = task.environment
    with tempfile.TemporaryDirectory(prefix="gyre-oracle-") as tmp:
        solution, home = Path(tmp, "solution"), Path(tmp, "home")
        shutil.copytree(Path(task.reference["solve_sh"]).parent, solution, symlinks=True)
        home.mkdir()
        mounts = [Mount(workspace, contract.workdir), Mount(solution, "/solution")]
        name = f"gyre-oracle-{Path(tmp).name}"
        try:
            if contract.image:
                argv = make_run_argv(task, ensure_image(task), name, mounts, {})
            else:
                mounts.append(Mount(home, str(home)))
                argv = make_contract_prefix(list_host_root(), mounts, contract.workdir, hide=[contract.task_dir])
            done = subprocess.run(
                [*argv, "bash", "/solution/solve.sh"],
                capture_output=True,
                text=True,
                timeout=task.time_budget_s,
                env={**os.environ, "HOME": str(home)},
            )
        except subprocess.TimeoutExpired:
            if contract.image:
                remove(name)
            raise WorkspaceError(f"task {task.task_id!r}: solution/solve.sh ran past {task.time_budget_s} s") from None
        except OSError as e:
            raise WorkspaceError(f"task {task.task_id!r}: cannot start the sandbox of solve.sh: {e}") from e
    if done.returncode != 0:
        raise WorkspaceError(
            f"task {task.task_id!r}: solution/solve.sh exited {done.returncode}: {(done.stdout + done.stderr)[-500:]}"
        )
