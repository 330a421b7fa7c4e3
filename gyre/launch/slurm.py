"""A run as one heterogeneous Slurm job, submitted with submitit; and the partition checks before it.

    component 0: coordinator, proxy, harness sandboxes (1 node)     make_run_components
    component 1..N: cell 0..N-1, `cluster.cell_nodes` nodes each

submitit has no het-job support, so the plan is rendered into what it does support: the first
component's resources as executor parameters, one `#SBATCH hetjob` block per further component
through `slurm_setup`, and `srun --het-group=0,...,n-1` so one step spans every component. The log
folder must not contain `%j` (submitit would resolve it per component).

Rendering and parsing here are pure; `query_partition` is the one command (`scontrol`).
"""

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit

from gyre.cells.config import ClusterConfig
from gyre.errors import ConfigError


@dataclass(frozen=True)
class Component:
    """Resources of one het-job component (one cell)."""

    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    mem_gb: int
    gpus_per_node: int


def make_cell_components(cluster: ClusterConfig, tasks_per_node: int = 1) -> list[Component]:
    """One component per cell, each `cell_nodes` nodes with the per-node resources of `cluster`."""
    cpus = max(1, cluster.cpus_per_node // tasks_per_node)
    cell = Component(cluster.cell_nodes, tasks_per_node, cpus, cluster.mem_gb_per_node, cluster.gpus_per_node)
    return [cell] * cluster.num_cells


def make_run_components(cluster: ClusterConfig) -> list[Component]:
    """The run's het job: the coordinator's component (one node, one task), then one per cell (a task
    per rank: `ranks_per_node` on each of its nodes)."""
    coordinator = Component(1, 1, cluster.coordinator_cpus, cluster.coordinator_mem_gb, 0)
    return [coordinator, *make_cell_components(cluster, cluster.ranks_per_node)]


def make_hetjob_parameters(cluster: ClusterConfig, components: list[Component]) -> dict[str, Any]:
    """submitit `update_parameters` kwargs that request `components` as one heterogeneous job."""
    first, rest = components[0], components[1:]
    params: dict[str, Any] = {
        "nodes": first.nodes,
        "tasks_per_node": first.tasks_per_node,
        "cpus_per_task": first.cpus_per_task,
        "mem_gb": first.mem_gb,
        "timeout_min": cluster.time_limit_min,
        "slurm_setup": [line for c in rest for line in make_component_lines(c, cluster)],
        "slurm_srun_args": [f"--het-group={','.join(str(i) for i in range(len(components)))}"] if rest else [],
    }
    if first.gpus_per_node:
        params["gpus_per_node"] = first.gpus_per_node
    if cluster.partition:
        params["slurm_partition"] = cluster.partition
    if cluster.account:
        params["slurm_account"] = cluster.account
    if cluster.sbatch_extra:
        params["slurm_additional_parameters"] = dict(_split_option(o) for o in cluster.sbatch_extra)
    return params


def make_component_lines(component: Component, cluster: ClusterConfig) -> list[str]:
    """The `#SBATCH` block that opens a further het-job component."""
    options = [
        f"--nodes={component.nodes}",
        f"--ntasks-per-node={component.tasks_per_node}",
        f"--cpus-per-task={component.cpus_per_task}",
        f"--mem={component.mem_gb}G",
        f"--time={cluster.time_limit_min}",
    ]
    if component.gpus_per_node:
        options.append(f"--gpus-per-node={component.gpus_per_node}")
    if cluster.partition:
        options.append(f"--partition={cluster.partition}")
    if cluster.account:
        options.append(f"--account={cluster.account}")
    options += [o if o.startswith("--") else f"--{o}" for o in cluster.sbatch_extra]
    return ["#SBATCH hetjob", *(f"#SBATCH {o}" for o in options)]


def _split_option(option: str) -> tuple[str, Any]:
    key, _, value = option.removeprefix("--").partition("=")
    return key, value if value else True


def make_hetjob_executor(
    cluster: ClusterConfig, components: list[Component], folder: Path, **extra: Any
) -> submitit.AutoExecutor:
    """An executor whose every submission is one het job of `components` (`extra`: more executor parameters)."""
    if "%j" in str(folder):
        raise ValueError(f"log folder {folder} must not contain %j for a heterogeneous job")
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    executor.update_parameters(**make_hetjob_parameters(cluster, components), **extra)
    return executor


# ---- partition limits ------------------------------------------------------------------------
class SlurmConfigError(ConfigError):
    """The cluster config asks for what the partition cannot grant (Slurm's own answer attached)."""


@dataclass(frozen=True)
class PartitionLimits:
    name: str
    total_nodes: int
    max_time_min: int | None
    """None: UNLIMITED/INFINITE."""
    max_nodes: int | None
    """Per-job node limit (MaxNodes); None: UNLIMITED."""
    state: str


def parse_partition(text: str) -> PartitionLimits:
    """Parse `scontrol show partition NAME --oneliner` (one `Key=Value` record)."""
    fields = dict(kv.split("=", 1) for kv in text.split() if "=" in kv)
    return PartitionLimits(
        fields["PartitionName"],
        int(fields["TotalNodes"]),
        parse_time_min(fields["MaxTime"]),
        None if fields.get("MaxNodes", "UNLIMITED") == "UNLIMITED" else int(fields["MaxNodes"]),
        fields.get("State", "UP"),
    )


def parse_time_min(value: str) -> int | None:
    """Slurm's `[days-]hours:minutes:seconds` (or `minutes`) in whole minutes, rounded down; None if unlimited."""
    if value in ("UNLIMITED", "INFINITE"):
        return None
    days, _, clock = value.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if len(parts) == 1:
        return int(days or 0) * 1440 + parts[0]
    h, m, sec = ([0] * (3 - len(parts)) + parts) if len(parts) < 3 else parts
    return int(days or 0) * 1440 + h * 60 + m + sec // 60


def check_fits(cluster: ClusterConfig, limits: PartitionLimits) -> None:
    """Raise SlurmConfigError naming the key when the run's het job cannot run on the partition."""
    nodes = 1 + cluster.num_nodes  # the coordinator's node, then the cells'
    where = f"partition {limits.name!r}"
    if limits.state != "UP":
        raise SlurmConfigError("cluster.partition", f"{where} is {limits.state}, not UP")
    if nodes > limits.total_nodes:
        raise SlurmConfigError(
            "cluster.num_cells",
            f"{cluster.num_cells} cells x cluster.cell_nodes="
            f"{cluster.cell_nodes} + 1 coordinator node = {nodes} nodes; {where} has "
            f"{limits.total_nodes}",
        )
    if limits.max_nodes is not None and cluster.cell_nodes > limits.max_nodes:
        raise SlurmConfigError(
            "cluster.cell_nodes", f"{cluster.cell_nodes} nodes per cell exceed {where}'s MaxNodes={limits.max_nodes}"
        )
    if limits.max_time_min is not None and cluster.time_limit_min > limits.max_time_min:
        raise SlurmConfigError(
            "cluster.time_limit_min",
            f"{cluster.time_limit_min} min exceeds {where}'s MaxTime of {limits.max_time_min} min",
        )


def query_partition(name: str | None) -> PartitionLimits:
    """The limits of partition `name` (None: the cluster's default partition), from `scontrol`.

    Raises:
        SlurmConfigError: no such partition (Slurm's message attached), or no default one.
    """
    out = subprocess.run(
        ["scontrol", "show", "partition", "--oneliner", *([name] if name else [])],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if out.returncode != 0 or not out.stdout.strip():
        known = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30).stdout.split()
        raise SlurmConfigError(
            "cluster.partition",
            f"Slurm says: {(out.stderr or out.stdout).strip()}; valid: {', '.join(sorted(set(known)))}",
        )
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    if name:
        return parse_partition(lines[0])
    defaults = [parse_partition(line) for line in lines if "Default=YES" in line]
    if not defaults:
        raise SlurmConfigError("cluster.partition", "the cluster has no default partition; set one")
    return defaults[0]
