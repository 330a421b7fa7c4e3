"""Harness sandboxes: one per execution, a fresh workspace, its own process group, a budget, limits.

    prepare(): <root>/<execution_id>/{workspace (fresh copy + setup), home (private HOME, TMPDIR)}
    start():   prlimit [container] [bwrap ...] harness-command   env: proxy URL, execution key, model; own group
    poll():    exited -> SandboxResult | past budget -> SIGTERM the group, after grace SIGKILL
    the workspace stays for the evaluator (partial credit for timed-out runs)

Isolation is bubblewrap: the whole filesystem read-only, the workspace and the private home
writable, /dev and /proc fresh, a pid namespace (the network is shared: the proxy is on loopback).
A write anywhere else fails with EROFS and shows in the harness log. Where bubblewrap cannot run
(not installed, no user namespaces in a container), `isolation=auto` says so once and falls back
to the plain runner; `isolation=bwrap` refuses to start.

Harbor tasks (`task.environment` set) need their paths: bubblewrap then builds a fresh root with
the workspace at the workdir (gyre/harness/contract.py) and the task folder masked, so tests/ and
solution/ stay unseen; `[environment].memory_mb` caps RLIMIT_AS below `harness.mem_limit_gb`
(not for harnesses run without one: Node reserves large address spaces) and `cpus` is a CFS quota
of the sandbox's own cgroup (gyre/cells/quota.py; where no cgroup is writable, a warning and no
cap). A Harbor task that needs an image (docker_image or environment/Dockerfile) runs in it with
`isolation=podman` (gyre/harness/podman.py: no network but a relay to the proxy; cpus and
memory_mb as the container's cgroup limits); without podman, or with another isolation, it is
refused naming the task and `harness.isolation`, as is one that would run without bubblewrap:
never run unisolated.

Apptainer/enroot on Slurm: the runner is the same inside the image (bubblewrap needs to be in the
image; unprivileged user namespaces must be allowed, which Apptainer's own sandbox also needs);
with `isolation=none` the container itself is the isolation. Sites that start each sandbox in
its own container set `harness.container_image`: `make_container_prefix` then wraps the harness
command (and bubblewrap, which then must be in the image) in `apptainer exec --contain --bind
<workspace>,<home> IMAGE` or `enroot start --rw --mount ...`; the environment passes through.
"""

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gyre.cells.quota import CGROUP_ROOT, CpuQuota, make_quota
from gyre.errors import GyreError
from gyre.harness.commands import make_harness_command
from gyre.harness.config import HarnessConfig
from gyre.harness.contract import Mount, list_host_root, make_contract_prefix
from gyre.harness.podman import copy_workdir, ensure_image, make_agent_argv, podman_available, proxy_port, remove
from gyre.tasks.spec import Task
from gyre.tasks.workspace import make_workspace, run_setup

log = logging.getLogger(__name__)
_bwrap_ok: bool | None = None


class SandboxError(GyreError):
    """A sandbox that cannot start (isolation required but unavailable, harness binary missing)."""


@dataclass(frozen=True)
class SandboxResult:
    exit_code: int
    """The harness's exit status (negative: killed by that signal)."""
    timed_out: bool
    """The wall-clock budget ended it (SIGTERM, then SIGKILL after the grace)."""
    duration_s: float
    workspace: Path
    log_path: Path


def make_bwrap_prefix(writable: list[Path], cwd: Path) -> list[str]:
    """bubblewrap argv: the root read-only, `writable` paths bound read-write (pure)."""
    argv = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid", "--die-with-parent"]
    for p in writable:
        argv += ["--bind", str(p), str(p)]
    return argv + ["--chdir", str(cwd), "--"]


def make_container_prefix(image: str, writable: list[Path], cwd: Path, runtime: str = "apptainer") -> list[str]:
    """`apptainer exec` / `enroot start` argv running a harness inside IMAGE (pure; Slurm sites)."""
    if runtime == "enroot":
        return ["enroot", "start", "--rw", *[a for p in writable for a in ("--mount", f"{p}:{p}")], image]
    return ["apptainer", "exec", "--contain", "--bind", ",".join(map(str, writable)), "--pwd", str(cwd), image]


def bwrap_available() -> bool:
    """Whether bubblewrap runs here (checked once per process)."""
    global _bwrap_ok
    if _bwrap_ok is None:
        binary = shutil.which("bwrap")
        try:
            _bwrap_ok = (
                binary is not None
                and subprocess.run(
                    [binary, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid", "true"],
                    capture_output=True,
                    timeout=30,
                ).returncode
                == 0
            )
        except (OSError, subprocess.TimeoutExpired):
            _bwrap_ok = False
        if not _bwrap_ok:
            log.warning(
                "bubblewrap (bwrap) cannot run here: harness sandboxes run unisolated "
                "(apt-get install bubblewrap; containers need user namespaces)"
            )
    return _bwrap_ok


def make_limits_prefix(cfg: HarnessConfig, memory_mb: int | None = None) -> list[str]:
    """util-linux `prlimit` argv setting the harness's rlimits, inherited by all it starts (pure).
    An exec'd wrapper rather than a preexec function: safe in a multi-threaded coordinator.
    A task's `memory_mb` lowers RLIMIT_AS where the harness has one."""
    mem = None if cfg.mem_limit_gb is None else int(cfg.mem_limit_gb * 2**30)
    if mem is not None and memory_mb is not None:
        mem = min(mem, memory_mb * 2**20)
    limits = [("cpu", cfg.cpu_limit_s), ("nproc", cfg.max_processes), ("as", mem)]
    flags = [f"--{name}={value}" for name, value in limits if value is not None]
    return ["prlimit", *flags, "--"] if flags else []


def make_cgroup_prefix(procs_file: str) -> list[str]:
    """argv of a shell that enters a cgroup (writes itself to `procs_file`), then execs the rest:
    nothing the harness starts can run outside it, and no preexec function is needed (pure)."""
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs_file]


def make_sandbox_quota(execution_id: str, cpus: float) -> CpuQuota | None:
    """A cgroup holding the sandbox to `cpus` CPUs, or None (with a warning) where none is writable."""
    writable = os.access(CGROUP_ROOT / "cpu", os.W_OK) or os.access(CGROUP_ROOT / "cgroup.controllers", os.W_OK)
    quota = make_quota(f"gyre-sandbox-{execution_id}", cpus, 0, top_weight=False) if writable else None
    if quota is not None and quota.mechanism.startswith("cgroup"):
        return quota
    log.warning("no writable cgroup: [environment].cpus=%g of %s is not enforced", cpus, execution_id)
    return None


def check_isolation(task: Task, cfg: HarnessConfig, bwrap_ok: bool, podman_ok: bool) -> None:
    """Refuse a Harbor task this sandbox cannot give its paths: never a silent unisolated run (pure).

    Raises:
        SandboxError: naming the task and `harness.isolation`.
    """
    env = task.environment
    if env is None:
        return
    if env.image:
        what = f"[environment].docker_image {env.docker_image}" if env.docker_image else env.dockerfile
        if cfg.isolation != "podman":
            raise SandboxError(
                f"task {task.task_id!r}: harness.isolation={cfg.isolation} cannot run a task that needs a container "
                f"image ({what}); set harness.isolation=podman"
            )
        if not podman_ok:
            raise SandboxError(
                f"task {task.task_id!r}: harness.isolation=podman but podman cannot run here, and the task needs "
                f"a container image ({what}); apt-get install podman (tools/setup.sh)"
            )
        return
    if not env.allow_internet:  # bubblewrap shares the host's network: the proxy is reached over it
        raise SandboxError(
            f"task {task.task_id!r}: harness.isolation={cfg.isolation}: [environment].allow_internet = false needs "
            "a task with an image run with harness.isolation=podman (a container without a network)"
        )
    if cfg.isolation == "none" or not bwrap_ok:
        why = "isolation=none" if cfg.isolation == "none" else "bubblewrap cannot run here"
        raise SandboxError(
            f"task {task.task_id!r}: harness.isolation: a Harbor task needs bubblewrap for {env.workdir}, "
            f"/tests and /logs ({why}); set harness.isolation=auto or bwrap where bubblewrap runs"
        )


def make_task_workspace(task: Task, dest: Path) -> Path:
    """A fresh workspace: a copy of the image's workdir for a task with an image, else of its source.

    Raises:
        PodmanError, WorkspaceError: the image or the source cannot be copied.
    """
    env = task.environment
    if env is None or not env.image:
        return make_workspace(task.workspace, dest)
    copy_workdir(ensure_image(task), env.workdir, dest)
    return dest


def make_agent_prefix(task: Task, workspace: Path, home: Path) -> list[str]:
    """The Harbor sandbox of the agent: WS at the workdir, HOME writable, the task folder masked."""
    env = task.environment
    mounts = [Mount(workspace, env.workdir), Mount(home, str(home))]
    return make_contract_prefix(list_host_root(), mounts, env.workdir, hide=[env.task_dir])


class Sandbox:
    """One execution's harness process: prepare, start, poll until it ends (or kill)."""

    def __init__(
        self,
        task: Task,
        execution_id: str,
        root: Path,
        harness: HarnessConfig,
        proxy_url: str,
        api_key: str,
        model: str,
    ):
        self.task, self.execution_id, self.cfg = task, execution_id, harness
        self.proxy_url, self.api_key, self.model = proxy_url, api_key, model
        self.dir = Path(root).resolve() / execution_id
        self.workspace, self.home, self.log_path = self.dir / "workspace", self.dir / "home", self.dir / "harness.log"
        self.isolated = False
        self.container = ""
        """The agent's podman container (a Harbor task with an image), else ''."""
        self._image = ""
        self._relay: subprocess.Popen | None = None
        self._relay_dir: Path | None = None
        self._quota: CpuQuota | None = None
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._started = self._term_at = 0.0
        self._result: SandboxResult | None = None

    def prepare(self) -> Path:
        """A fresh workspace copy with the task's setup run in it, and a private home.

        Raises:
            SandboxError: a Harbor task this sandbox cannot run (check_isolation).
            PodmanError: the task's image cannot be pulled, built or copied from.
            WorkspaceError: the source cannot be copied or the setup failed.
        """
        contract = self.task.environment
        if contract is not None:
            bwrap_ok = self.cfg.isolation != "none" and bwrap_available()
            check_isolation(self.task, self.cfg, bwrap_ok, self.cfg.isolation == "podman" and podman_available())
        if contract is not None and contract.image:
            self.container = "gyre-" + re.sub(r"[^A-Za-z0-9_.-]", "-", self.execution_id)
            self._image = ensure_image(self.task)
            copy_workdir(self._image, contract.workdir, self.workspace)
        else:
            make_workspace(self.task.workspace, self.workspace)
        run_setup(self.task, self.workspace)
        (self.home / "tmp").mkdir(parents=True, exist_ok=True)
        return self.workspace

    def start(self) -> None:
        """Start the harness (non-blocking) in its own process group, under the budget's clock.

        Raises:
            SandboxError: isolation=bwrap where bubblewrap cannot run, or the harness is missing.
        """
        if self.container:
            self._start_podman()
            return
        contract = self.task.environment
        inside = Path(contract.workdir) if contract else self.workspace
        argv, env = make_harness_command(
            self.cfg, self.task.instruction, inside, self.proxy_url, self.api_key, self.model, self.home
        )
        env.update(GYRE_EXECUTION_ID=self.execution_id, TMPDIR=str(self.home / "tmp"))
        if contract is not None:  # prepare() has checked that bubblewrap can give its paths
            self.isolated = True
            prefix = make_limits_prefix(self.cfg, contract.memory_mb)
            if contract.cpus is not None and (quota := make_sandbox_quota(self.execution_id, contract.cpus)):
                self._quota = quota
                prefix += make_cgroup_prefix(str(Path(quota.path, "cgroup.procs")))
            self._popen(prefix + make_agent_prefix(self.task, self.workspace, self.home) + argv, env)
            return
        want = self.cfg.isolation
        self.isolated = want in ("bwrap", "podman") or (want == "auto" and bwrap_available())
        if want in ("bwrap", "podman") and not bwrap_available():
            raise SandboxError(f"harness.isolation={want} but bubblewrap cannot run here; use auto or none")
        if self.isolated:
            argv = make_bwrap_prefix([self.workspace, self.home], self.workspace) + argv
        if self.cfg.container_image:
            argv = (
                make_container_prefix(
                    self.cfg.container_image, [self.workspace, self.home], self.workspace, self.cfg.container_runtime
                )
                + argv
            )
        self._popen(make_limits_prefix(self.cfg) + argv, env)

    def _start_podman(self) -> None:
        """The harness in the task's image; its one way out is the relay pair to the proxy (podman.py)."""
        host, port = proxy_port(self.proxy_url)
        workdir = self.task.environment.workdir
        argv, env = make_harness_command(
            self.cfg,
            self.task.instruction,
            Path(workdir),
            f"http://127.0.0.1:{port}",
            self.api_key,
            self.model,
            self.home,
        )
        env.update(GYRE_EXECUTION_ID=self.execution_id, TMPDIR=str(self.home / "tmp"))
        self._relay_dir = Path(tempfile.mkdtemp(prefix="gyre-relay-"))  # short: a socket path has 107 bytes
        listener = socket.socket(socket.AF_UNIX)
        try:  # bound before either relay starts: no race between them
            listener.bind(str(self._relay_dir / "proxy.sock"))
            listener.listen(64)
            with open(self.dir / "relay.log", "ab") as relay_log:
                self._relay = subprocess.Popen(
                    [sys.executable, "-m", "gyre.harness.relay", "--listen", f"fd:{listener.fileno()}"]
                    + ["--to", f"tcp:{host}:{port}"],
                    pass_fds=(listener.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=relay_log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        finally:
            listener.close()
        container = make_agent_argv(
            self.cfg, self.task, self._image, self.container, self.workspace, self.home, self._relay_dir, env, port
        )
        self.isolated = True
        try:
            self._popen(container + argv, env)
        except SandboxError:
            self._stop_container(0)
            raise

    def _stop_container(self, code: int) -> None:
        """Stop the host relay; remove a container its killed `podman run` left behind."""
        if self._relay is not None:
            self._relay.kill()
            self._relay.wait()
            shutil.rmtree(self._relay_dir, ignore_errors=True)
        if code != 0:
            remove(self.container)

    def _popen(self, argv: list[str], env: dict[str, str]) -> None:
        self._log = open(self.log_path, "ab")
        self._started = time.monotonic()
        try:
            self._proc = subprocess.Popen(
                argv,
                cwd=self.workspace,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as e:
            self._log.close()
            raise SandboxError(f"cannot start harness {argv[0]!r}: {e}") from e

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass

    def poll(self) -> SandboxResult | None:
        """The result once the harness has exited, else None; enforces the budget (cheap, non-blocking)."""
        if self._result is not None or self._proc is None:
            return self._result
        now = time.monotonic()
        code = self._proc.poll()
        if code is None:
            if not self._term_at and now - self._started > self.task.time_budget_s:
                self._term_at = now
                self._signal(signal.SIGTERM)
            elif self._term_at and now - self._term_at > self.cfg.grace_s:
                self._signal(signal.SIGKILL)
            return None
        self._signal(signal.SIGKILL)  # what the harness left running in its group
        self._log.close()
        if self.container:
            self._stop_container(code)
        if self._quota is not None:
            self._quota.remove(timeout_s=1.0)
        self._result = SandboxResult(code, bool(self._term_at), now - self._started, self.workspace, self.log_path)
        return self._result

    def kill(self) -> None:
        """SIGKILL the whole group now (shutdown); poll() then returns the result."""
        if self._proc is not None and self._result is None:
            self._signal(signal.SIGKILL)
            self._proc.wait()
            self.poll()

    def wait(self, poll_interval_s: float = 0.05) -> SandboxResult:
        """Poll until the harness ends (for one-off runs; the coordinator polls many)."""
        while (result := self.poll()) is None:
            time.sleep(poll_interval_s)
        return result
