"""Which Harbor tasks a sandbox can run as Harbor would, refused by name otherwise (pure).

Never a silent unisolated run, and never a run bound to a false 0: a task whose image, network, GPUs
or verification this sandbox cannot give is refused before it starts, naming the task, the task.toml
field and the Gyre key that decide it.
"""

from gyre.errors import GyreError
from gyre.harness.config import HarnessConfig
from gyre.tasks.spec import Task


class SandboxError(GyreError):
    """A sandbox that cannot start (isolation required but unavailable, harness binary missing)."""


def agent_network(task: Task, cfg: HarnessConfig) -> str:
    """The agent's network ("public" | "none"): the task's, unless the site allows none (harness.agent_network)."""
    return "none" if cfg.agent_network == "none" else task.environment.agent_network


def _check_network(task: Task, cfg: HarnessConfig, where: str) -> None:
    env = task.environment
    if cfg.agent_network == "none" and env.agent_network_asked and env.agent_network == "public":
        raise SandboxError(
            f"{where}: its task.toml asks a public network for the agent ([agent].network_mode, "
            "[environment].network_mode or allow_internet) and harness.agent_network=none allows none"
        )
    net = agent_network(task, cfg)
    if env.verification == "shared" and env.verifier_network_asked and env.verifier_network != net:
        raise SandboxError(
            f"{where}: [verifier].network_mode: {env.verifier_network} differs from the agent's {net}, and shared "
            "verification runs in the agent's environment, whose network is set when it starts; set "
            '[verifier].environment_mode = "separate" or the same network_mode'
        )


def check_isolation(task: Task, cfg: HarnessConfig, bwrap_ok: bool, podman_ok: bool) -> None:
    """Refuse a Harbor task this sandbox cannot run as Harbor would.

    Raises:
        SandboxError: naming the task, the field and the key (harness.isolation, harness.agent_network).
    """
    env = task.environment
    if env is None:
        return
    where = f"task {task.task_id!r}"
    if env.gpus > 0:
        raise SandboxError(f"{where}: [environment].gpus = {env.gpus}: Gyre's sandboxes get no GPU (a CPU cell)")
    _check_network(task, cfg, where)
    if env.image:
        what = f"[environment].docker_image {env.docker_image}" if env.docker_image else env.dockerfile
        if cfg.isolation != "podman":
            raise SandboxError(
                f"{where}: harness.isolation={cfg.isolation} cannot run a task that needs a container "
                f"image ({what}); set harness.isolation=podman"
            )
        if not podman_ok:
            raise SandboxError(
                f"{where}: harness.isolation=podman but podman cannot run here, and the task needs "
                f"a container image ({what}); apt-get install podman (tools/setup.sh)"
            )
        return
    if cfg.isolation == "none" or not bwrap_ok:
        why = "isolation=none" if cfg.isolation == "none" else "bubblewrap cannot run here"
        raise SandboxError(
            f"{where}: harness.isolation: a Harbor task needs bubblewrap for {env.workdir}, "
            f"/tests and /logs ({why}); set harness.isolation=auto or bwrap where bubblewrap runs"
        )
