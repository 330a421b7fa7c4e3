"""Harbor tasks in their own image (`harness.isolation=podman`): Harbor's paths inside a podman container.

    image:     `[environment].docker_image` (a short name is tried under each of `harness.image_registries`,
               docker.io first, as Docker implies it; `localhost/...` is used as is), or built once from
               environment/Dockerfile (tag: the task id and a hash of environment/'s files); pull and
               build are bounded by `[environment].build_timeout_sec`
    workdir:   `[environment].workdir`, else the image's WORKDIR (`podman image inspect`), as Harbor
    workspace: a copy of the image's workdir (`podman cp` once per image into WORKDIR_CACHE), kept on the host
    phases:    one container per execution (gyre/harness/environment.py), the agent, the oracle and
               the verifier each a `podman exec` in it; the agent's container also binds the private
               HOME and the harness's Python (read-only, at their host paths; the task folder masked
               where it lies inside them); the harness runs under the relay

The proxy is reached through the relay whatever the network: inside the container the relay
(gyre/harness/relay.py, the harness its child) listens on 127.0.0.1 at the proxy's port, so the
proxy URL works unchanged, and carries each connection over a unix socket bound into the container
to a relay on the host that connects to the proxy. The container gets podman's default network
where the agent's `network_mode` is public (Harbor's default) and the site allows it
(`harness.agent_network`), else none.

The harness runs from the host's install, bound read-only: the image must provide the C library
and shared libraries that Python links (Debian and Ubuntu images do; the relay and the toy agent
need libssl). Harnesses that need Node (claude_code, codex) need it in the image.
"""

import dataclasses
import hashlib
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from gyre.common.files import publish
from gyre.common.wait import wait_until
from gyre.errors import GyreError
from gyre.harness.config import HarnessConfig
from gyre.harness.contract import Mount
from gyre.harness.roots import harness_installs
from gyre.tasks.harbor import check_workdir
from gyre.tasks.spec import Task, TaskSpecError

log = logging.getLogger(__name__)
RELAY_DIR = "/gyre/relay"
"""Where the agent's container sees the folder holding the relay's unix socket."""
DEFAULT_NPROC = 4096
"""RLIMIT_NPROC in a container where none is configured (the verifier, the oracle, max_processes=null)."""
COPY_TIMEOUT_S = 600.0
"""How long copying an image's workdir to the host may take."""
DEFAULT_REGISTRIES = ("docker.io",)
"""Registries a short image name is tried under, in order (Docker's implied registry)."""
SYSTEM_DIRS = ("/", "/bin", "/etc", "/lib", "/lib64", "/sbin", "/usr", "/usr/local", "/var")
"""Host folders never bound into an image: they would hide the image's own."""
WORKDIR_CACHE = Path(tempfile.gettempdir(), "gyre-image-workdirs")
"""Host copies of images' workdirs, one per image ID and workdir: each workspace is copied from one."""
_image_lock = threading.Lock()
_podman_ok: bool | None = None


class PodmanError(GyreError):
    """podman cannot give a task its image (missing runtime, failed pull or build, harness not bindable)."""


def podman(args: list[str], timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """Run one podman command (a hung one is a PodmanError, as a failed one is for its caller)."""
    try:
        return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise PodmanError(f"podman {' '.join(args[:2])} took over {timeout_s:g} s") from None


def podman_available() -> bool:
    """Whether podman answers here (checked once per process)."""
    global _podman_ok
    if _podman_ok is None:
        try:
            _podman_ok = podman(["info", "--format", "{{.Host.OCIRuntime.Name}}"], 60).returncode == 0
        except (OSError, PodmanError):
            _podman_ok = False
    return _podman_ok


def dockerfile_tag(task_id: str, env_dir: Path) -> str:
    """The local tag of an image built from `env_dir`: a new one whenever a file in it changes."""
    digest = hashlib.sha256()
    for path in sorted(p for p in env_dir.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(env_dir)).encode() + b"\0" + path.read_bytes() + b"\0")
    return f"localhost/gyre-harbor-{task_id.lower()}:{digest.hexdigest()[:16]}"


def _image_id(ref: str) -> str | None:
    done = podman(["image", "inspect", "--format", "{{.Id}}", ref])
    return done.stdout.strip() if done.returncode == 0 else None


def qualify_image(name: str, registries: tuple[str, ...] = DEFAULT_REGISTRIES) -> list[str]:
    """The references a pull tries for `name` (pure): as written when it names a registry (a first
    part with a dot or a port, or `localhost`), else under each registry (Docker Hub's official images
    under `library/`)."""
    first = name.split("/", 1)[0]
    if "/" in name and ("." in first or ":" in first or first == "localhost"):
        return [name]
    return [f"{r}/{'library/' if '/' not in name and r == 'docker.io' else ''}{name}" for r in registries]


def ensure_image(task: Task, registries: tuple[str, ...] = DEFAULT_REGISTRIES) -> str:
    """The ID of the task's image in podman's store, pulled or built on first use (an ID, not a tag:
    the workspace copy and the containers of one execution come from the same image), each pull or
    build bounded by `[environment].build_timeout_sec`.

    Raises:
        PodmanError: the pull or the build failed or ran past its time (naming the task and the image).
    """
    env = task.environment
    dockerfile = Path(env.dockerfile) if not env.docker_image else None
    refs = qualify_image(env.docker_image, registries) if dockerfile is None else []
    refs = refs or [dockerfile_tag(task.task_id, dockerfile.parent)]
    errors = []
    with _image_lock:  # executions of one task start in parallel threads: one build
        for ref in dict.fromkeys([env.docker_image, *refs] if env.docker_image else refs):
            if image_id := _image_id(ref):
                return image_id
        for ref in refs:
            args = (
                ["pull", ref]
                if dockerfile is None
                else ["build", "-t", ref, "-f", str(dockerfile), str(dockerfile.parent)]
            )
            try:
                done = podman(args, env.build_timeout_s)
            except PodmanError as e:
                errors.append(str(e))
                continue
            if done.returncode == 0 and (image_id := _image_id(ref)):
                return image_id
            errors.append(f"podman {args[0]} {ref}: {done.stderr.strip()[-300:]}")
    raise PodmanError(f"task {task.task_id!r}: its image cannot be had: {'; '.join(errors)}")


def image_workdir(image_id: str) -> str:
    """The image's WORKDIR ('' where it sets none)."""
    done = podman(["image", "inspect", "--format", "{{.Config.WorkingDir}}", image_id])
    return done.stdout.strip() if done.returncode == 0 else ""


def with_image_workdir(task: Task, image_id: str) -> Task:
    """`task` with the image's WORKDIR as its workdir where the task.toml names none (Harbor's reading).

    Raises:
        PodmanError: the image sets no WORKDIR (or / or a path the sandbox cannot mount at).
    """
    if task.environment.workdir:
        return task
    workdir = image_workdir(image_id)
    try:
        workdir = check_workdir(workdir, f"task {task.task_id!r}")
    except TaskSpecError as e:
        raise PodmanError(f"{e} (the image's WORKDIR; set [environment].workdir)") from None
    return dataclasses.replace(task, environment=dataclasses.replace(task.environment, workdir=workdir))


def copy_workdir(image_id: str, workdir: str, dest: Path) -> None:
    """Copy the image's `workdir` to `dest` (created; empty where the image has no such folder),
    from a host copy made once per image and workdir (`podman create` + `podman cp` take ~0.6 s).

    Raises:
        PodmanError: the container could not be created.
    """
    cache = WORKDIR_CACHE / f"{image_id[:24]}{workdir.replace('/', '-')}"
    if not cache.is_dir():
        fresh = WORKDIR_CACHE / f".{cache.name}-{uuid.uuid4().hex}"
        fresh.mkdir(parents=True)
        name = f"gyre-copy-{uuid.uuid4().hex[:12]}"
        done = podman(["create", "--name", name, image_id, "true"])  # never started: the command is a formality
        if done.returncode != 0:
            raise PodmanError(f"podman create {image_id[:12]} failed: {done.stderr.strip()[-500:]}")
        try:
            podman(["cp", f"{name}:{workdir}/.", str(fresh)], COPY_TIMEOUT_S)  # fails where there is no workdir
        finally:
            podman(["rm", "--force", name])
        try:
            publish(fresh, cache)  # atomic: a concurrent copy of the same image keeps the first
        except OSError:
            shutil.rmtree(fresh, ignore_errors=True)
    shutil.copytree(cache, dest, symlinks=True)


def remove(name: str, timeout_s: float = 30.0) -> None:
    """Remove a container that may outlive its `podman run` (a client killed at a timeout), retrying
    while it is still there: conmon, detached from the killed client, may still be initialising it
    (seen on a loaded box: a container left "Initialized" after one rm). A failure is logged, not
    raised: the execution has ended either way."""
    failed = ""

    def removed() -> bool:
        nonlocal failed
        try:
            done = podman(["rm", "--force", "--ignore", "--time", "0", name])
            failed = done.stderr.strip() if done.returncode else ""
            return podman(["container", "exists", name]).returncode != 0
        except (OSError, PodmanError) as e:
            failed = str(e)
            return False

    if not wait_until(removed, timeout_s, interval_s=0.2):
        log.warning("could not remove container %s: %s", name, failed[-300:] or "it is still there")


def make_run_argv(
    task: Task, image: str, name: str, mounts: list[Mount], env: dict[str, str], flags: list[str] = ()
) -> list[str]:
    """`podman run` argv up to the command, in the workdir with the task's cpus / memory_mb as its
    cgroup's limits, each mount a volume, each env entry an --env, `flags` (the network among them)
    before the image (pure but for reading this
    process's open-files limit). The open-files and process limits are always set: podman's
    defaults (1048576) can sit above what the host allows, and the OCI runtime then refuses to start."""
    contract = task.environment
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    argv = ["podman", "run", "--rm", "--name", name, "--workdir", contract.workdir, "--ulimit", f"nofile={soft}:{hard}"]
    if not any(f.startswith("nproc=") for f in flags):
        argv += ["--ulimit", f"nproc={DEFAULT_NPROC}:{DEFAULT_NPROC}"]
    if contract.cpus is not None:
        argv += ["--cpus", f"{contract.cpus:g}"]
    if contract.memory_mb is not None:
        argv += ["--memory", f"{contract.memory_mb}m"]
    for m in mounts:
        argv += ["--volume", f"{m.source}:{m.dest}:{'rw' if m.writable else 'ro'}"]
    for key, value in sorted(env.items()):
        argv += ["--env", f"{key}={value}"]
    return [*argv, *flags, image]


def make_limit_flags(cfg: HarnessConfig) -> list[str]:
    """podman's flags for the harness's rlimits (pure)."""
    limits = (("nproc", cfg.max_processes or DEFAULT_NPROC), ("cpu", cfg.cpu_limit_s))
    return [a for name, value in limits if value is not None for a in ("--ulimit", f"{name}={value}:{value}")]


def harness_mounts(argv: list[str] = ()) -> list[Path]:
    """The host folders the harness runs from (gyre/harness/roots.py: this Python, the gyre package,
    the program of `argv`), bound read-only into the agent's container; the image's own system
    folders stay.

    Raises:
        PodmanError: this Python is a system one: binding it would hide the image's.
    """
    if bad := sorted({str(p) for p in map(Path, (sys.prefix, sys.base_prefix)) if str(p.resolve()) in SYSTEM_DIRS}):
        raise PodmanError(
            f"harness.isolation=podman: the harness's Python lives in {', '.join(bad)}, which would hide the "
            "image's own; run Gyre from a Python of its own (a uv or pyenv install, as tools/setup.sh makes)"
        )
    system = [Path(d) for d in SYSTEM_DIRS if d != "/"]
    return [p for p in harness_installs(list(argv)) if not any(p == d or d in p.parents for d in system)]


def proxy_port(proxy_url: str) -> tuple[str, int]:
    """(host, port) of the proxy (pure)."""
    parts = urlsplit(proxy_url)
    return parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)


def container_env(env: dict[str, str]) -> dict[str, str]:
    """What of the harness's environment the container gets: what Gyre set, not the host's own (pure
    but for reading os.environ); PYTHONPATH passes, for a Gyre run from its source tree."""
    keep = {k: v for k, v in env.items() if os.environ.get(k) != v}
    return keep | ({"PYTHONPATH": env["PYTHONPATH"]} if "PYTHONPATH" in env else {})


def make_agent_extras(
    cfg: HarnessConfig, task: Task, relay_dir: Path, argv: list[str] = ()
) -> tuple[list[Mount], list[str]]:
    """(mounts, flags) the agent's container adds to the environment's: the relay's folder, the
    harness's install (read-only; `argv`: the harness command), its rlimits, and the task folder
    masked where it lies inside them.

    Raises:
        PodmanError: the harness's Python is a system one (harness_mounts).
    """
    bound = harness_mounts(argv)
    mounts = [Mount(relay_dir, RELAY_DIR), *(Mount(p, str(p), writable=False) for p in bound)]
    flags = make_limit_flags(cfg)
    task_dir = Path(task.environment.task_dir)
    if any(p in task_dir.parents for p in bound):  # a task set inside Gyre's tree: its tests/ stay unseen
        flags += ["--tmpfs", f"{task_dir}:notmpcopyup"]  # podman copies what it covers into a tmpfs by default
    return mounts, flags


def make_relay_argv(port: int) -> list[str]:
    """The relay the harness runs under inside the container, listening at the proxy's port (pure)."""
    relay = ["--listen", f"tcp:127.0.0.1:{port}", "--to", f"unix:{RELAY_DIR}/proxy.sock", "--"]
    return [sys.executable, "-m", "gyre.harness.relay", *relay]
