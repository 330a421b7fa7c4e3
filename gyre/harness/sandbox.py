"""Harness sandboxes: one per execution, a fresh workspace, its own process group, a budget, limits.

    prepare(): <root>/<execution_id>/{workspace (fresh copy + setup), home (private HOME, TMPDIR)}
    start():   prlimit [container] [bwrap ...] harness-command   env: proxy URL, execution key, model; own group
    poll():    exited -> SandboxResult | past budget -> SIGTERM the group, after grace SIGKILL
    the workspace stays for the evaluator (partial credit for timed-out runs)

Isolation is bubblewrap: an allowlist root (gyre/harness/roots.py: the system folders, the
harness's install, read-only; no home folders, task set or run directory), the workspace and the
private home writable, /dev, /proc and /tmp fresh, a pid namespace (the network is shared: the
proxy is on loopback). A write anywhere else fails with EROFS and shows in the harness log (or
lands in the sandbox's own /tmp). Where bubblewrap cannot run (not installed, no user namespaces
in a container), `isolation=auto` says so once and falls back to the plain runner;
`isolation=bwrap` refuses to start.

Harbor tasks (`task.environment` set) run in their environment (gyre/harness/environment.py): a
bubblewrap holder with a fresh root, the workspace at the workdir (gyre/harness/contract.py) and the
task folder masked, so tests/ and solution/ stay unseen; or, for a task that needs an image
(docker_image or environment/Dockerfile), a podman container of it with `isolation=podman`
(gyre/harness/podman.py: the proxy through a relay). The environment outlives the harness for the
verifier (`environment`, ended by `close()`); a multi-step task's steps each start a harness in it
(`next_step`, gyre/harness/steps.py). `[environment].memory_mb` caps RLIMIT_AS below
`harness.mem_limit_gb` (not for harnesses run without one: Node reserves large address spaces)
and `cpus` is a CFS quota of the sandbox's own cgroup (gyre/cells/quota.py; where no cgroup is
writable, a warning and no cap), both the container's limits under podman. A task this sandbox
cannot run as Harbor would is refused naming the task, the field and the key
(gyre/harness/task_checks.py): never run unisolated, never run to a false 0.

Apptainer/enroot on Slurm: the runner is the same inside the image (bubblewrap needs to be in the
image; unprivileged user namespaces must be allowed, which Apptainer's own sandbox also needs);
with `isolation=none` the container itself is the isolation. Sites that start each sandbox in
its own container set `harness.container_image`: `make_container_prefix` then wraps the harness
command (and bubblewrap, which then must be in the image) in `apptainer exec --contain --bind
<workspace>,<home> IMAGE` or `enroot start --rw --mount ...`; the environment passes through.
"""

import logging
import os
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
from gyre.harness.agents import (
    MINI_SWE_SESSION_FILE,
    SESSION_TRANSCRIPTS,
    codex_thread_id,
    harness_session_id,
    session_transcript,
    trim_torn_line,
)
from gyre.harness.commands import HarnessSession, make_harness_command
from gyre.harness.config import HarnessConfig
from gyre.harness.contract import Mount
from gyre.harness.environment import BaseTaskEnv, install_mounts, open_environment
from gyre.harness.podman import (
    RELAY_DIR,
    container_env,
    copy_workdir,
    ensure_image,
    make_agent_extras,
    make_relay_argv,
    podman_available,
    proxy_port,
    with_image_workdir,
)
from gyre.harness.roots import list_root
from gyre.harness.task_checks import SandboxError, agent_network, check_isolation
from gyre.harness.toy_agent import SESSION_FILE
from gyre.harness.workspace import make_workspace, run_setup
from gyre.tasks.spec import Task, step_task
from gyre.trajectory.rewards import Evaluation

log = logging.getLogger(__name__)
_bwrap_ok: bool | None = None
_storage_noted: set[str] = set()


@dataclass(frozen=True)
class SandboxResult:
    exit_code: int
    """The harness's exit status (negative: killed by that signal)."""
    timed_out: bool
    """The wall-clock budget ended it (SIGTERM, then SIGKILL after the grace)."""
    duration_s: float
    """The harness's seconds (a multi-step task's: of its steps so far)."""
    workspace: Path
    log_path: Path


def make_bwrap_prefix(root: list[str], writable: list[Path], cwd: Path) -> list[str]:
    """bubblewrap argv: the allowlist `root` (gyre/harness/roots.py), `writable` paths bound
    read-write, the rest of the root read-only (pure)."""
    argv = ["bwrap", *root]
    for p in writable:
        argv += ["--bind", str(p), str(p)]
    return argv + ["--remount-ro", "/", "--unshare-pid", "--die-with-parent", "--chdir", str(cwd), "--"]


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


def make_task_workspace(task: Task, dest: Path) -> Path:
    """A fresh workspace: a copy of the image's workdir for a task with an image, else of its source.

    Raises:
        PodmanError, WorkspaceError: the image or the source cannot be copied.
    """
    env = task.environment
    if env is None or not env.image:
        return make_workspace(task.workspace, dest)
    image = ensure_image(task)
    copy_workdir(image, with_image_workdir(task, image).environment.workdir, dest)
    return dest


def start_host_relay(log_path: Path, host: str, port: int) -> tuple[subprocess.Popen, Path]:
    """(the host's relay, its folder): it accepts on the folder's unix socket, bound into the agent's
    container, and connects each client to the proxy at host:port (gyre/harness/relay.py)."""
    relay_dir = Path(tempfile.mkdtemp(prefix="gyre-relay-"))  # short: a socket path has 107 bytes
    listener = socket.socket(socket.AF_UNIX)
    try:  # bound before either relay starts: no race between them
        listener.bind(str(relay_dir / "proxy.sock"))
        listener.listen(64)
        with open(log_path, "ab") as relay_log:
            relay = subprocess.Popen(
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
    return relay, relay_dir


def continuable(task: Task, cfg: HarnessConfig, sandbox_dir: Path) -> str | None:
    """Why an interrupted execution cannot continue its harness session (None: it can): the toy
    agent's session file in its home, Claude Code's session transcript (its id the execution's),
    Codex's thread (from its log's `thread.started`), mini-swe-agent's session file (Gyre's agent
    class writes it), Qwen Code's session transcript (as Claude Code's); a command's sessions are
    not continued, and a Harbor task's environment (its services, its container) does not outlive
    the job."""
    workspace, home = sandbox_dir / "workspace", sandbox_dir / "home"
    if task.environment is not None:
        return "a Harbor task's environment does not outlive the job"
    if not workspace.is_dir():
        return f"no workspace under {sandbox_dir}"
    if cfg.kind == "toy":
        saved = home / SESSION_FILE
    elif cfg.kind in ("claude_code", "qwen_code"):
        saved = session_transcript(cfg.kind, home, harness_session_id(sandbox_dir.name))
        return None if saved is not None else f"no saved {cfg.kind} session in its home"
    elif cfg.kind == "codex":
        return None if _codex_thread(sandbox_dir) else "no thread.started event in its harness log"
    elif cfg.kind == "mini_swe_agent":
        saved = home / MINI_SWE_SESSION_FILE
    else:
        return f"harness.kind={cfg.kind} does not continue its sessions yet"
    return None if saved.is_file() else f"no saved session at {saved}"


def _codex_thread(sandbox_dir: Path) -> str | None:
    log_path = sandbox_dir / "harness.log"
    return codex_thread_id(log_path.read_text(errors="replace")) if log_path.is_file() else None


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
        self.environment: BaseTaskEnv | None = None
        """A Harbor task's environment, started with the harness and left for its verifier (close())."""
        self._image = ""
        self._relay: subprocess.Popen | None = None
        self._relay_dir: Path | None = None
        self._port = 0
        """The proxy's port, where the relay listens inside the environment."""
        self._quota: CpuQuota | None = None
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._started = self._term_at = 0.0
        self._used_s = 0.0
        """The time budget a continued execution used before the restart that interrupted it."""
        self.step = 0
        """A multi-step task's running step (gyre/harness/steps.py); its harness sees `step_task`."""
        self.steps_done: list[tuple[str, Evaluation]] = []
        """A multi-step task's verified steps: (name, Evaluation), in order (gyre/harness/steps.py)."""
        self._steps_s = 0.0
        sid = harness_session_id(execution_id) if harness.kind in SESSION_TRANSCRIPTS else None
        self._session = HarnessSession(sid)
        self._result: SandboxResult | None = None

    def resume(self, used_s: float) -> Path:
        """Continue an execution a restart interrupted: its workspace and home as they were (the
        harness's session in the home), under what is left of its time budget.

        Raises:
            SandboxError: nothing this sandbox can continue (`continuable` says why).
        """
        if (why := continuable(self.task, self.cfg, self.dir)) is not None:
            raise SandboxError(f"execution {self.execution_id} cannot continue: {why}")
        if self.cfg.kind in SESSION_TRANSCRIPTS:
            trim_torn_line(session_transcript(self.cfg.kind, self.home, self._session.id))
        sid = _codex_thread(self.dir) if self.cfg.kind == "codex" else self._session.id
        self._used_s, self._session = used_s, HarnessSession(sid, resume=True)
        return self.workspace

    def prepare(self) -> Path:
        """A fresh workspace copy with the task's setup run in it, and a private home.

        Raises:
            SandboxError: a Harbor task this sandbox cannot run (check_isolation).
            PodmanError: the task's image cannot be pulled, built or copied from.
            TaskEnvError: a Harbor task's environment did not start.
            WorkspaceError: the source cannot be copied or the setup failed.
        """
        contract = self.task.environment
        if contract is not None:
            bwrap_ok = self.cfg.isolation != "none" and bwrap_available()
            check_isolation(self.task, self.cfg, bwrap_ok, self.cfg.isolation == "podman" and podman_available())
        if contract is not None and contract.storage_mb is not None and self.task.task_id not in _storage_noted:
            _storage_noted.add(self.task.task_id)
            log.info("task %s: [environment].storage_mb is read, not enforced (no disk quota)", self.task.task_id)
        if contract is not None and contract.image:
            self._image = ensure_image(self.task, tuple(self.cfg.image_registries))
            self.task = with_image_workdir(self.task, self._image)
            copy_workdir(self._image, self.task.environment.workdir, self.workspace)
        else:
            make_workspace(self.task.workspace, self.workspace)
        run_setup(self.task, self.workspace)
        (self.home / "tmp").mkdir(parents=True, exist_ok=True)
        if contract is not None:
            self._open_environment()
        return self.workspace

    def start(self) -> None:
        """Start the harness (non-blocking) in its own process group, under the budget's clock.

        Raises:
            SandboxError: isolation=bwrap where bubblewrap cannot run, or the harness is missing.
        """
        if self.task.environment is not None:
            self._start_harbor()
            return
        argv, env = make_harness_command(
            self.cfg,
            self.task.instruction,
            self.workspace,
            self.proxy_url,
            self.api_key,
            self.model,
            self.home,
            self._session,
        )
        env.update(GYRE_EXECUTION_ID=self.execution_id, TMPDIR=str(self.home / "tmp"))
        want = self.cfg.isolation
        self.isolated = want in ("bwrap", "podman") or (want == "auto" and bwrap_available())
        if want in ("bwrap", "podman") and not bwrap_available():
            raise SandboxError(f"harness.isolation={want} but bubblewrap cannot run here; use auto or none")
        if self.isolated:
            argv = make_bwrap_prefix(list_root(argv, env), [self.workspace, self.home], self.workspace) + argv
        if self.cfg.container_image:
            argv = (
                make_container_prefix(
                    self.cfg.container_image, [self.workspace, self.home], self.workspace, self.cfg.container_runtime
                )
                + argv
            )
        self._popen(make_limits_prefix(self.cfg) + argv, env)

    def _open_environment(self) -> None:
        """Start the Harbor task's environment (gyre/harness/environment.py), which outlives the
        harness for the verifier; with an image, or without a network, the proxy is reached through
        the relay pair (podman.py), whose host side starts here too."""
        contract, network = self.task.environment, agent_network(self.task, self.cfg)
        try:
            if contract.image or network == "none":
                host, self._port = proxy_port(self.proxy_url)
                self._relay, self._relay_dir = start_host_relay(self.dir / "relay.log", host, self._port)
            harness = make_harness_command(self.cfg, "", self.workspace, self.proxy_url, "", "", self.home)[0]
            if contract.image:  # podman sets the container's limits
                extras = make_agent_extras(self.cfg, self.task, self._relay_dir, harness)
            else:  # `cpus` holds the whole environment, as a container's
                holder = []
                if contract.cpus is not None and (quota := make_sandbox_quota(self.execution_id, contract.cpus)):
                    self._quota, holder = quota, make_cgroup_prefix(str(Path(quota.path, "cgroup.procs")))
                relay = [Mount(self._relay_dir, RELAY_DIR)] if self._relay_dir else []
                extras = ([*install_mounts(harness), *relay], holder)  # the harness's install, wherever it lives
            # Started in prepare()'s thread (the coordinator's executor threads live as long as its
            # loop): bubblewrap's --die-with-parent follows the thread that started it.
            self.environment = open_environment(self.task, self.workspace, network, self.home, extras, self._image)
        except (GyreError, OSError):
            self.close()
            raise

    def next_step(self) -> None:
        """Start the next step's harness in the same environment, afresh as Harbor starts each step's
        agent (gyre/harness/steps.py): the toy agent's saved session of the step before is removed.

        Raises:
            SandboxError: the harness cannot start.
        """
        self._steps_s = self._result.duration_s  # the steps' so far
        self.step += 1
        (self.home / SESSION_FILE).unlink(missing_ok=True)
        self._proc = self._result = None
        self._term_at = 0.0
        self._start_harbor()

    @property
    def budget_s(self) -> float:
        """The running harness's time budget: the task's, or its running step's."""
        return self.task.steps[self.step].time_budget_s if self.task.steps else self.task.time_budget_s

    def _start_harbor(self) -> None:
        """The harness in the task's environment (of its running step: instruction, user), under the
        relay where there is one; without an image, the harness's rlimits apply inside."""
        phase = step_task(self.task, self.step) if self.task.steps else self.task
        contract = phase.environment
        url = f"http://127.0.0.1:{self._port}" if self._relay is not None else self.proxy_url
        argv, env = make_harness_command(
            self.cfg, phase.instruction, Path(contract.workdir), url, self.api_key, self.model, self.home
        )
        env.update(GYRE_EXECUTION_ID=self.execution_id, TMPDIR=str(self.home / "tmp"), **contract.env)
        if self._relay is not None:
            argv = make_relay_argv(self._port) + argv
        if not contract.image:
            argv = make_limits_prefix(self.cfg, contract.memory_mb) + argv
        inner = container_env(env) if contract.image else {}
        self.isolated = True
        try:
            self._popen(self.environment.enter(argv, inner, contract.agent_user), env)
        except (GyreError, OSError):
            self.close()
            raise

    def _stop_relay(self) -> None:
        if self._relay is not None:
            self._relay.kill()
            self._relay.wait()
            shutil.rmtree(self._relay_dir, ignore_errors=True)
            self._relay = None

    def close(self) -> None:
        """End the task's environment (after its verifier ran, or when the execution is dropped)."""
        self._stop_relay()
        if self.environment is not None:
            self.environment.close()
        if self._quota is not None:
            self._quota.remove(timeout_s=1.0)
            self._quota = None

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
            if not self._term_at and now - self._started + self._used_s > self.budget_s:
                self._term_at = now
                self._signal(signal.SIGTERM)
            elif self._term_at and now - self._term_at > self.cfg.grace_s:
                self._signal(signal.SIGKILL)
            return None
        self._signal(signal.SIGKILL)  # what the harness left running in its group
        self._log.close()
        if self.step + 1 >= len(self.task.steps):  # no step follows that needs the relay
            self._stop_relay()
        if self._term_at and self.environment is not None:
            self.environment.kill_all()  # past its budget: what it runs inside stops too (podman exec's do not)
        used = now - self._started + self._used_s  # a continued execution's budget counts the time before the break
        self._result = SandboxResult(code, bool(self._term_at), used + self._steps_s, self.workspace, self.log_path)
        return self._result

    def kill(self) -> None:
        """SIGKILL the whole group now (shutdown); poll() then returns the result."""
        if self._proc is not None and self._result is None:
            self._signal(signal.SIGKILL)
            self._proc.wait()
            self.poll()
        self.close()

    def wait(self, poll_interval_s: float = 0.05) -> SandboxResult:
        """Poll until the harness ends (for one-off runs; the coordinator polls many)."""
        while (result := self.poll()) is None:
            time.sleep(poll_interval_s)
        return result
