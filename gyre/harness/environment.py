"""One Harbor execution's environment: started once, entered by each phase, as Harbor's shared mode runs
a trial (harbor src/harbor/trial/trial.py: the agent, then the verifier, in one started environment).

    bubblewrap  a holder `bwrap <contract root> python -m gyre.harness.envd serve` (with no network: a
                network namespace of its own) that starts each phase inside (gyre/harness/envd.py):
                the same tmpfs root (new top-level folders), /tmp and HOME, and what the agent left
                running (the host's folders stay read-only: bubblewrap 0.8 has no overlay)
    podman      a container `podman run -d ... sleep <lifetime>`; each phase is a `podman exec`
    /tests      bound from the host, empty until the verifier's turn, then a fresh copy of tests/
    /logs       bound from the host (agent/, verifier/, artifacts/); verifier/ is emptied right
                before the verifier runs, so a reward the agent planted is gone
    /solution   the oracle's: a copy of solution/ put in before solve.sh runs

The holder lives `lifetime_s` at most, so an environment nobody closes (a crashed coordinator) ends
by itself. `close()` ends it and removes its host folders; it is idempotent.
"""

import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from gyre.common.wait import wait_until
from gyre.errors import GyreError
from gyre.harness.contract import Mount, make_contract_prefix
from gyre.harness.envd import KILL_ALL
from gyre.harness.podman import ensure_image, make_run_argv, podman, remove, with_image_workdir
from gyre.harness.roots import harness_installs, list_secrets, list_system_root
from gyre.tasks.spec import Task

BOUND = ("tests", "logs", "solution")
"""Host folders of the environment bound at /tests, /logs, /solution."""
LOG_DIRS = ("agent", "verifier", "artifacts")
"""Harbor's /logs subfolders (EnvironmentPaths): the agent's, the verifier's, the artifacts'."""
START_TIMEOUT_S = 60.0
LIFETIME_MARGIN_S = 900.0
"""An environment outlives its agent's budget and its verifier's time by this much at most."""
# Every pid but the container's holder (pid 1) and this shell.
_KILL_ALL = 'for p in /proc/[0-9]*; do p=${p#/proc/}; [ "$p" -gt "$0" ] && [ "$p" != $$ ] && kill -9 "$p"; done'


class TaskEnvError(GyreError):
    """An environment that cannot start or be entered (names the task)."""


def empty_folder(folder: Path) -> None:
    """Remove what `folder` holds, keeping the folder itself: it is a bind mount's source, and a new
    folder of the same name would not be seen inside."""
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


class BaseTaskEnv:
    """The host side of one environment: its bound folders, and what each phase runs through."""

    backend = ""

    def __init__(self, task: Task, workspace: Path, home: Path | None = None):
        self.task, self.workspace = task, Path(workspace)
        self.state = Path(tempfile.mkdtemp(prefix="gyre-env-"))
        self.home = home or self.state / "home"
        """A private HOME, bound at its own path (the agent's, or one of the environment's own)."""
        for name in (*BOUND, "home"):
            (self.state / name).mkdir()
        for name in LOG_DIRS:  # writable by `[agent].user` and `[verifier].user`, whoever they are
            (self.state / "logs" / name).mkdir()
            (self.state / "logs" / name).chmod(0o777)
        self.closed = False

    @property
    def verifier_logs(self) -> Path:
        """Host path of /logs/verifier (reward.txt / reward.json)."""
        return self.state / "logs" / "verifier"

    def mounts(self) -> list[Mount]:
        """The workspace at the workdir, the bound folders, and the private HOME at its own path."""
        workdir = self.task.environment.workdir
        return [
            Mount(self.workspace, workdir),
            *(Mount(self.state / n, f"/{n}") for n in BOUND),
            Mount(self.home, str(self.home)),
        ]

    def put(self, dest: str, *sources: Path) -> None:
        """Replace what /tests or /solution holds with a copy of `sources` (folders), each copied over
        the ones before it (a step's tests/ over its task's)."""
        target = self.state / dest.strip("/")
        empty_folder(target)
        for source in sources:
            shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)

    def clear_verifier_logs(self) -> None:
        """Empty /logs/verifier: whatever the agent wrote there is not the verifier's."""
        empty_folder(self.verifier_logs)
        self.verifier_logs.chmod(0o777)  # as made, whatever the agent did to it

    def enter(self, argv: list[str], env: dict[str, str], user: str | None = None) -> list[str]:
        """argv running `argv` inside, in the workdir, with `env` set, as `user` (None: the default)."""
        raise NotImplementedError

    def kill_all(self) -> None:
        """Kill every process a phase left inside (a phase past its time limit), keeping the environment."""
        raise NotImplementedError

    def close(self) -> None:
        """End the environment and remove its host folders (idempotent)."""
        if not self.closed:
            self.closed = True
            self._stop()
            shutil.rmtree(self.state, ignore_errors=True)

    def _stop(self) -> None:
        raise NotImplementedError


def install_mounts(argv: list[str] = ()) -> list[Mount]:
    """The harness's install (roots.harness_installs: this Python, the gyre package, the program of
    `argv`), bound read-only at its own paths wherever it lives: the holder runs from it too."""
    return [Mount(p, str(p), writable=False) for p in harness_installs(list(argv))]


class BwrapTaskEnv(BaseTaskEnv):
    """The environment as a bubblewrap sandbox on the host (a task without an image), held by
    gyre/harness/envd.py, through which each phase enters it (unprivileged, unlike nsenter)."""

    backend = "bwrap"

    @property
    def socket(self) -> Path:
        """The holder's socket: its folder is bound into the sandbox at the same path."""
        return self.state / "envd" / "envd.sock"

    def start(self, lifetime_s: float, network: str = "public", extra: list[Mount] = (), flags: list[str] = ()) -> None:
        """Start the holder under `flags` (an argv prefix: the environment's cgroup). `network`
        "public" shares the host's, "none" is a network namespace of its own with only a loopback
        (the agent then reaches the proxy through the relay in `extra`).

        Raises:
            TaskEnvError: the holder did not start within START_TIMEOUT_S.
        """
        env = self.task.environment
        self.socket.parent.mkdir()
        installs = [*install_mounts(), *(m for m in extra if not m.writable)]  # first: the rest may sit inside
        mounts = [*installs, *self.mounts(), Mount(self.socket.parent, str(self.socket.parent))]
        mounts += [m for m in extra if m.writable]
        prefix = make_contract_prefix(list_system_root(), list_secrets(), mounts, env.workdir, hide=[env.task_dir])
        net = ["--unshare-net"] if network == "none" else []
        holder = [sys.executable, "-m", "gyre.harness.envd", "serve", str(self.socket), f"{lifetime_s:g}"]
        self.proc = subprocess.Popen(
            [*flags, *prefix[:-1], *net, "--", *holder],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        ended = wait_until(lambda: self.socket.exists() or self.proc.poll() is not None, START_TIMEOUT_S, 0.01)
        if not (ended and self.socket.exists()):  # the holder exited, or did not listen in time
            self.proc.kill()
            err = self.proc.communicate()[1].decode(errors="replace")
            self.proc = None
            raise TaskEnvError(f"task {self.task.task_id!r}: bubblewrap environment did not start: {err[-500:]}")

    def enter(self, argv: list[str], env: dict[str, str], user: str | None = None) -> list[str]:
        assigns = [f"{k}={v}" for k, v in sorted(env.items())]
        who = ["--user", user] if user is not None else []
        cwd = self.task.environment.workdir
        return [*self._client(["--cwd", cwd, *who]), "env", *assigns, *argv]

    def kill_all(self) -> None:
        subprocess.run([*self._client([]), KILL_ALL], timeout=30, check=False, capture_output=True)

    def _client(self, flags: list[str]) -> list[str]:
        return [sys.executable, "-m", "gyre.harness.envd", "enter", str(self.socket), *flags, "--"]

    def _stop(self) -> None:
        if getattr(self, "proc", None) is not None:
            self.proc.kill()
            self.proc.communicate()


class PodmanTaskEnv(BaseTaskEnv):
    """The environment as a running podman container from the task's image."""

    backend = "podman"

    def __init__(self, task: Task, workspace: Path, image: str, home: Path | None = None):
        super().__init__(task, workspace, home)
        self.image, self.name = image, f"gyre-env-{uuid.uuid4().hex[:12]}"

    def start(self, lifetime_s: float, network: str, extra: list[Mount] = (), flags: list[str] = ()) -> None:
        """Start the container (detached) with `network` ("public" | "none").

        Raises:
            TaskEnvError: podman could not start it.
        """
        net = ["--network=none"] if network == "none" else []
        argv = make_run_argv(self.task, self.image, self.name, [*self.mounts(), *extra], {}, [*net, *flags, "-d"])
        done = podman([*argv[1:], "sleep", f"{max(1, int(lifetime_s))}"], START_TIMEOUT_S)
        if done.returncode != 0:
            remove(self.name)
            raise TaskEnvError(
                f"task {self.task.task_id!r}: podman could not start its container: {done.stderr[-500:]}"
            )

    def enter(self, argv: list[str], env: dict[str, str], user: str | None = None) -> list[str]:
        flags = ["--workdir", self.task.environment.workdir, *(["--user", user] if user is not None else [])]
        assigns = [a for k, v in sorted(env.items()) for a in ("--env", f"{k}={v}")]
        return ["podman", "exec", *flags, *assigns, self.name, *argv]

    def kill_all(self) -> None:
        subprocess.run(["podman", "exec", self.name, "sh", "-c", _KILL_ALL, "1"], timeout=30, check=False)

    def _stop(self) -> None:
        remove(self.name)


def lifetime_s(task: Task) -> float:
    """How long an environment may live: the agent's budget, the verifier's time (of each step, for a
    multi-step task) and a margin."""
    phases = [(s.time_budget_s, s.evaluator.timeout_s) for s in task.steps] or [
        (task.time_budget_s, task.evaluator.timeout_s)
    ]
    return sum(agent + verifier for agent, verifier in phases) + LIFETIME_MARGIN_S


def open_environment(
    task: Task,
    workspace: Path,
    network: str,
    home: Path | None = None,
    extras: tuple[list[Mount], list[str]] = ([], []),
    image: str = "",
) -> BaseTaskEnv:
    """A started environment for `task` on `workspace`: bubblewrap, or podman from the task's image
    (`image`: its ID, else pulled or built) with the image's WORKDIR where the task names none.
    The environment's `task` is the task with that workdir. `extras`: (mounts added, podman's run
    flags or the argv prefix bubblewrap's holder starts under).

    Raises:
        PodmanError: the image cannot be had or has no usable WORKDIR.
        TaskEnvError: the environment did not start.
    """
    if not task.environment.image:
        env = BwrapTaskEnv(task, workspace, home)
    else:
        image = image or ensure_image(task)
        env = PodmanTaskEnv(with_image_workdir(task, image), workspace, image, home)
    try:
        env.start(lifetime_s(task), network, *extras)
    except BaseException:
        env.close()
        raise
    return env
