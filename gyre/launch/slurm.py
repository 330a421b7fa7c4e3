"""One heterogeneous Slurm job of cells, submitted with submitit.

submitit has no het-job support, so the plan is rendered into what it does support: the first
cell's resources as executor parameters, one `#SBATCH hetjob` block per further cell through
`slurm_setup`, and `srun --het-group=0,...,n-1` so one step spans every cell. The log folder must
not contain `%j` (submitit would resolve it per component).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit

from gyre.launch.config import ClusterConfig


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


def make_cells_executor(cluster: ClusterConfig, folder: Path, tasks_per_node: int = 1) -> submitit.AutoExecutor:
    """An executor whose every submission is one het job with a component per cell."""
    if "%j" in str(folder):
        raise ValueError(f"log folder {folder} must not contain %j for a heterogeneous job")
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    executor.update_parameters(**make_hetjob_parameters(cluster, make_cell_components(cluster, tasks_per_node)))
    return executor
