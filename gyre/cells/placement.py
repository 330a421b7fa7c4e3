"""Where this process runs inside a Slurm job: the one module that reads (and clears) SLURM_* variables.

In a heterogeneous step (`srun --het-group=0,1,...`) a task is not told its component directly;
it is derived from SLURM_PROCID and the per-component task counts.
"""

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gyre.errors import GyreError


class NotInSlurmJob(GyreError):
    """Raised when placement is asked for outside a Slurm job step."""


@dataclass(frozen=True)
class SlurmPlacement:
    job_id: str
    global_rank: int
    """Rank of this task among all tasks of the step (all components)."""
    num_tasks: int
    het_group: int
    """Component of the heterogeneous job this task belongs to (0 in a plain job)."""
    het_size: int
    """Components in the job (1 in a plain job)."""
    group_rank: int
    """Rank of this task within its component."""
    group_nodes: str
    """Nodes of this task's component, in Slurm's compressed syntax (e.g. `n[1-2]`)."""
    node: str
    """The node this task runs on."""
    restart_count: int = 0
    """How often the job was requeued before this run (SLURM_RESTART_COUNT; 0 on the first)."""
    group_tasks: int = 1
    """Tasks of this task's component (a cell's ranks: cell_nodes x ranks_per_node, block-placed)."""
    local_id: int = 0
    """This task's place among its step's tasks on its node (SLURM_LOCALID): a cell rank's local rank
    and CUDA device, checked against the cell's plan (gyre.cells.serving.plan_cell)."""


def parse_placement(env: Mapping[str, str]) -> SlurmPlacement:
    """Derive the placement of a task from its Slurm environment.

    Raises:
        NotInSlurmJob: when the variables of a job step are missing.
    """
    try:
        job_id, rank, ntasks = env["SLURM_JOB_ID"], int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    except KeyError as e:
        raise NotInSlurmJob(f"{e.args[0]} is not set: not inside a Slurm job step") from None
    node = env.get("SLURMD_NODENAME", env.get("SLURM_TOPOLOGY_ADDR", ""))
    het_size, restarts = int(env.get("SLURM_HET_SIZE", "1")), int(env.get("SLURM_RESTART_COUNT", "0"))
    local_id = int(env.get("SLURM_LOCALID", "0"))
    if het_size == 1:
        nodes = env.get("SLURM_JOB_NODELIST", "")
        return SlurmPlacement(
            job_id, rank, ntasks, 0, 1, rank, nodes, node, restarts, group_tasks=ntasks, local_id=local_id
        )
    first_rank = 0
    for group in range(het_size):
        group_tasks = int(env[f"SLURM_NTASKS_HET_GROUP_{group}"])
        if rank < first_rank + group_tasks:
            nodes = env[f"SLURM_JOB_NODELIST_HET_GROUP_{group}"]
            return SlurmPlacement(
                job_id,
                rank,
                ntasks,
                group,
                het_size,
                rank - first_rank,
                nodes,
                node,
                restarts,
                group_tasks=group_tasks,
                local_id=local_id,
            )
        first_rank += group_tasks
    raise NotInSlurmJob(f"SLURM_PROCID={rank} is beyond the {first_rank} tasks of the step's components")


def current_placement() -> SlurmPlacement:
    """The placement of the calling process (submitted as a job function, it reports where it ran)."""
    return parse_placement(os.environ)


def forget_enclosing_job() -> None:
    """Submitted from inside a job (a sweep through hydra-submitit-launcher runs each gyre-train in
    one), the run must not inherit that job's identity: sbatch passes the environment on, and the
    run's tasks would take the launcher's SLURM_ARRAY_JOB_ID for their own. SLURM_CONF stays."""
    for key in [k for k in os.environ if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        del os.environ[key]
