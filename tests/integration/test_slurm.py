"""submitit against the real dev Slurm cluster (tools/slurm-dev): results, het jobs, cancellations."""

import time

import pytest
import submitit

from gyre.launch.config import ClusterConfig
from gyre.launch.environment import current_placement
from gyre.launch.slurm import make_cells_executor

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]


def test_autoexecutor_returns_a_result(tmp_path):
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="slurm")
    executor.update_parameters(timeout_min=5, mem_gb=1, cpus_per_task=1)
    job = executor.submit(pow, 3, 4)
    assert job.result() == 81


def test_hetjob_runs_one_task_per_cell(tmp_path):
    cluster = ClusterConfig(backend="slurm", num_cells=2, cell_nodes=2, cpus_per_node=1, mem_gb_per_node=1,
                            time_limit_min=5)
    submitted = make_cells_executor(cluster, tmp_path, tasks_per_node=1).submit(current_placement)
    # submitit counts only the first component's tasks; the step has one task per node of every cell.
    job = submitit.SlurmJob(folder=tmp_path, job_id=submitted.job_id, tasks=range(cluster.num_nodes))
    placements = [job.task(rank).result() for rank in range(cluster.num_nodes)]
    assert [p.het_group for p in placements] == [0, 0, 1, 1]
    assert [p.group_rank for p in placements] == [0, 1, 0, 1]
    assert {p.het_size for p in placements} == {2}
    assert placements[0].group_nodes != placements[2].group_nodes
    assert len({p.node for p in placements}) == 4, "each task runs on its own node"


def test_cancelled_job_is_reported_failed(tmp_path):
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="slurm")
    executor.update_parameters(timeout_min=5, mem_gb=1, cpus_per_task=1)
    job = executor.submit(time.sleep, 300)
    deadline = time.monotonic() + 60
    while job.state not in ("RUNNING",) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job.state == "RUNNING"
    job.cancel()
    with pytest.raises(submitit.core.utils.UncompletedJobError):
        job.result()
    assert job.state.startswith("CANCELLED")
