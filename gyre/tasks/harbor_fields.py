"""Harbor task.toml fields beyond paths and limits, each read as Harbor reads it or refused by name (pure).

network   [environment].network_mode is the baseline, [agent] / [verifier].network_mode override it
          per phase; `allow_internet` is its deprecated spelling (Harbor docs, tasks/network-policy);
          an allowlist with no `allowed_hosts` denies all egress (= no network), one with hosts is
          refused: neither bubblewrap nor podman can filter egress by host
env       [environment].env (every phase), [verifier].env, [solution].env: a value that is
          exactly `${VAR}` or `${VAR:-default}` is read from the host, as harbor/utils/env.py
          `resolve_env_vars` does; a `${VAR}` the host lacks is an error naming it
users     [agent].user, [verifier].user: a user name or uid the phase runs as
steps     [[steps]] and multi_step_reward_strategy: gyre/tasks/harbor_steps.py (what of a step Gyre
          cannot run is refused there, by name)
refused   environment/docker-compose.yaml (multi-container tasks)
"""

import os
import re
from pathlib import Path

from gyre.tasks.spec import TaskSpecError

NETWORK_MODES = ("public", "no-network", "allowlist")
VERIFICATION_MODES = ("shared", "separate")
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
_TEMPLATE = re.compile(r"\$\{([^}:]+)(?::-(.*))?\}")


def _phase_network(table: dict, name: str, baseline: str | None, where: str) -> tuple[str, bool]:
    """("public" | "none", whether the task asked for it) of one phase."""
    mode = table.get("network_mode", baseline)
    field = f"{name}.network_mode" if "network_mode" in table else "environment.network_mode"
    if mode is None:
        return "public", False  # Harbor's default
    if mode not in NETWORK_MODES:
        raise TaskSpecError(where, field, f"{mode!r} is not one of {', '.join(NETWORK_MODES)}")
    if mode == "allowlist":
        hosts = table.get("allowed_hosts", [])
        if hosts:
            raise TaskSpecError(
                where, field, f"allowlist {hosts}: neither bubblewrap nor podman can limit egress to named hosts"
            )
        return "none", True  # Harbor: "empty or omitted hosts deny all egress"
    return ("public" if mode == "public" else "none"), True


def parse_networks(agent: dict, verifier: dict, env: dict, where: str) -> tuple[str, bool, str, bool]:
    """(agent's network, whether the task named it, verifier's network, whether the task named it);
    each network "public" | "none".

    Raises:
        TaskSpecError: an unknown mode, a non-boolean allow_internet, or an allowlist with hosts.
    """
    allow = env.get("allow_internet")
    if allow is not None and not isinstance(allow, bool):
        raise TaskSpecError(where, "environment.allow_internet", f"must be true or false, got {allow!r}")
    baseline = env.get("network_mode", None if allow is None else ("public" if allow else "no-network"))
    if baseline is not None:
        _phase_network({"network_mode": baseline, **env}, "environment", None, where)  # validates the baseline
    agent_net, asked = _phase_network(agent, "agent", baseline, where)
    verifier_net, verifier_asked = _phase_network(verifier, "verifier", baseline, where)
    return agent_net, asked, verifier_net, verifier_asked


def resolve_env(table: dict, name: str, where: str, host: dict[str, str] | None = None) -> dict[str, str]:
    """`[<name>].env` with whole-value `${VAR}` / `${VAR:-default}` templates read from `host` (os.environ).

    Raises:
        TaskSpecError: not a table of strings, or a `${VAR}` without a default that the host lacks.
    """
    host = os.environ if host is None else host
    env = table.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise TaskSpecError(where, f"{name}.env", "must be a table of names to strings")
    out = {}
    for key, value in env.items():
        m = _TEMPLATE.fullmatch(value)
        if m is None:
            out[key] = value
        elif m[1] in host:
            out[key] = host[m[1]]
        elif m[2] is not None:
            out[key] = m[2]
        else:
            raise TaskSpecError(where, f"{name}.env", f"{key}: the host has no variable {m[1]} and no default is given")
    return out


def parse_user(table: dict, name: str, where: str) -> str | None:
    """`[<name>].user`: a user name or uid (as text), or None: the environment's default user."""
    user = table.get("user")
    if user is None:
        return None
    if isinstance(user, bool) or not isinstance(user, (str, int)) or (isinstance(user, int) and user < 0):
        raise TaskSpecError(where, f"{name}.user", f"must be a user name or uid, got {user!r}")
    return str(user)


def parse_verification(verifier: dict, where: str) -> str:
    """`[verifier].environment_mode`: shared (Harbor's default: the agent's environment) or separate."""
    mode = verifier.get("environment_mode", "shared")
    if mode not in VERIFICATION_MODES:
        raise TaskSpecError(where, "verifier.environment_mode", f"{mode!r} is not one of shared, separate")
    return mode


def check_unsupported(folder: Path, where: str) -> None:
    """Refuse what Gyre does not run, naming it: multi-container tasks.

    Raises:
        TaskSpecError: naming the compose file.
    """
    for name in COMPOSE_FILES:
        if (folder / "environment" / name).is_file():
            raise TaskSpecError(
                where, f"environment/{name}", "multi-container (compose) environments are not run by Gyre"
            )


def parse_gpus(env: dict, where: str) -> int:
    """`[environment].gpus`: how many GPUs the task needs (0: none)."""
    gpus = env.get("gpus", 0)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise TaskSpecError(where, "environment.gpus", f"must be a whole number >= 0, got {gpus!r}")
    return gpus
