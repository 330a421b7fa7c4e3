"""Pure launch helpers: placement from Slurm variables, the het-job plan rendered for submitit, partition
limits parsed and checked, and the preemption signal kept from children."""

import os
import subprocess
import sys
import textwrap

import pytest

from gyre.cells.config import ClusterConfig
from gyre.cells.placement import NotInSlurmJob, forget_enclosing_job, parse_placement
from gyre.errors import ConfigError
from gyre.launch.slurm import (
    PartitionLimits,
    check_fits,
    make_cell_components,
    make_hetjob_parameters,
    make_run_components,
    parse_partition,
    parse_time_min,
)

# Variables as Slurm 22.05 set them in a step `srun --het-group=0,1` over components of 2 and 1 nodes.
HET_STEP = {
    "SLURM_JOB_ID": "3",
    "SLURM_NTASKS": "3",
    "SLURM_HET_SIZE": "2",
    "SLURM_NTASKS_HET_GROUP_0": "2",
    "SLURM_NTASKS_HET_GROUP_1": "1",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "n[1-2]",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "n3",
    "SLURM_JOB_NODELIST": "n[1-3]",
}


@pytest.mark.parametrize(
    "env, expected",
    [
        pytest.param(
            {
                "SLURM_JOB_ID": "7",
                "SLURM_PROCID": "1",
                "SLURM_NTASKS": "2",
                "SLURM_JOB_NODELIST": "n[4-5]",
                "SLURMD_NODENAME": "n5",
                "SLURM_LOCALID": "0",
            },
            dict(het_group=0, het_size=1, group_rank=1, group_nodes="n[4-5]", node="n5", group_tasks=2, local_id=0),
            id="plain-job",
        ),
        pytest.param(
            {**HET_STEP, "SLURM_PROCID": "0", "SLURMD_NODENAME": "n1"},
            dict(het_group=0, het_size=2, group_rank=0, group_nodes="n[1-2]", node="n1"),
            id="het-first",
        ),
        pytest.param(
            {**HET_STEP, "SLURM_PROCID": "1", "SLURMD_NODENAME": "n2", "SLURM_LOCALID": "3"},
            dict(het_group=0, het_size=2, group_rank=1, group_nodes="n[1-2]", node="n2", group_tasks=2, local_id=3),
            id="het-first-rank1",
        ),
        pytest.param(
            {**HET_STEP, "SLURM_PROCID": "2", "SLURMD_NODENAME": "n3"},
            dict(het_group=1, het_size=2, group_rank=0, group_nodes="n3", node="n3", group_tasks=1),
            id="het-second",
        ),
    ],
)
def test_parse_placement(env, expected):
    placement = parse_placement(env)
    assert {k: getattr(placement, k) for k in expected} == expected


@pytest.mark.parametrize(
    "env",
    [
        pytest.param({}, id="no-job"),
        pytest.param({**HET_STEP, "SLURM_PROCID": "3"}, id="rank-beyond-components"),
    ],
)
def test_parse_placement_rejects_non_steps(env):
    with pytest.raises(NotInSlurmJob):
        parse_placement(env)


def test_hetjob_parameters_for_three_cells():
    cluster = ClusterConfig(
        num_cells=3,
        cell_nodes=2,
        cpus_per_node=4,
        mem_gb_per_node=16,
        gpus_per_node=8,
        partition="gpu",
        sbatch_extra=["--constraint=h200"],
    )
    params = make_hetjob_parameters(cluster, make_cell_components(cluster))
    assert params["nodes"] == 2 and params["gpus_per_node"] == 8 and params["slurm_partition"] == "gpu"
    assert params["slurm_srun_args"] == ["--het-group=0,1,2"]
    assert params["slurm_additional_parameters"] == {"constraint": "h200"}
    block = [
        "#SBATCH hetjob",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=4",
        "#SBATCH --mem=16G",
        "#SBATCH --time=60",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --constraint=h200",
    ]
    assert params["slurm_setup"] == block * 2


def test_single_cell_is_a_plain_job():
    params = make_hetjob_parameters(ClusterConfig(num_cells=1), make_cell_components(ClusterConfig(num_cells=1)))
    assert params["slurm_setup"] == [] and params["slurm_srun_args"] == []


def test_run_components_put_the_coordinator_first():
    cluster = ClusterConfig(
        backend="slurm",
        num_cells=3,
        cell_nodes=8,
        cpus_per_node=1,
        mem_gb_per_node=1,
        gpus_per_node=4,
        coordinator_cpus=2,
        coordinator_mem_gb=3,
    )
    first, *cells = make_run_components(cluster)
    assert (first.nodes, first.tasks_per_node, first.cpus_per_task, first.mem_gb, first.gpus_per_node) == (
        1,
        1,
        2,
        3,
        0,
    )
    assert len(cells) == 3 and {(c.nodes, c.gpus_per_node) for c in cells} == {(8, 4)}
    params = make_hetjob_parameters(cluster, [first, *cells])
    assert params["slurm_srun_args"] == ["--het-group=0,1,2,3"] and "gpus_per_node" not in params
    assert params["slurm_setup"].count("#SBATCH hetjob") == 3


def test_a_slurm_cell_runs_a_task_per_rank_on_each_of_its_nodes():
    cluster = ClusterConfig(backend="slurm", num_cells=1, cell_nodes=2, ranks_per_node=4, cpus_per_node=8)
    assert cluster.ranks_per_cell == 8  # cell_nodes x ranks_per_node
    _, cell = make_run_components(cluster)
    assert (cell.nodes, cell.tasks_per_node, cell.cpus_per_task) == (2, 4, 2)
    with pytest.raises(ConfigError) as e:
        ClusterConfig(backend="slurm", cell_nodes=2, ranks_per_cell=3)
    assert e.value.key == "ranks_per_cell" and "cell_nodes x ranks_per_node = 2" in str(e.value)
    with pytest.raises(ConfigError) as e:
        ClusterConfig(ranks_per_node=2)  # local cells place no nodes
    assert e.value.key == "ranks_per_node"


def test_the_control_plane_is_mpi_on_slurm_and_tcp_locally_unless_chosen():
    assert ClusterConfig().control == "tcp" and ClusterConfig(backend="slurm").control == "mpi"
    assert ClusterConfig(backend="slurm", control="tcp").control == "tcp"


@pytest.mark.parametrize(
    "value, minutes",
    [
        pytest.param("UNLIMITED", None, id="unlimited"),
        pytest.param("INFINITE", None, id="infinite"),
        pytest.param("30", 30, id="minutes"),
        pytest.param("1:30:00", 90, id="h-m-s"),
        pytest.param("2-00:00:00", 2880, id="days"),
        pytest.param("05:30", 5, id="m-s"),
    ],
)
def test_parse_time_min(value, minutes):
    assert parse_time_min(value) == minutes


# `scontrol show partition --oneliner` as Slurm 22.05 prints it (shortened).
PARTITION = (
    "PartitionName=gpu AllowGroups=ALL Default=NO MaxNodes=UNLIMITED MaxTime=2-00:00:00 MinNodes=0 "
    "Nodes=g[1-12] State=UP TotalCPUs=96 TotalNodes=12"
)


def test_parse_partition():
    assert parse_partition(PARTITION) == PartitionLimits("gpu", 12, 2880, None, "UP")


LIMITS = PartitionLimits("gpu", 12, 120, 8, "UP")


@pytest.mark.parametrize(
    "fields, key",
    [
        pytest.param(dict(num_cells=2, cell_nodes=4), None, id="fits"),
        pytest.param(dict(num_cells=3, cell_nodes=4), "cluster.num_cells", id="coordinator-node-over-total"),
        pytest.param(dict(num_cells=1, cell_nodes=9, allocation_nodes=None), "cluster.cell_nodes", id="over-max-nodes"),
        pytest.param(dict(num_cells=1, cell_nodes=2, time_limit_min=121), "cluster.time_limit_min", id="over-max-time"),
    ],
)
def test_check_fits_names_the_key(fields, key):
    cluster = ClusterConfig(backend="slurm", **fields)
    if key is None:
        check_fits(cluster, LIMITS)
        return
    with pytest.raises(ConfigError) as e:
        check_fits(cluster, LIMITS)
    assert e.value.key == key and "gpu" in str(e.value)


def test_down_partition_is_refused():
    with pytest.raises(ConfigError, match="DOWN"):
        check_fits(ClusterConfig(backend="slurm", num_cells=1), PartitionLimits("gpu", 12, None, None, "DOWN"))


def test_allocation_nodes_decide_the_cells_and_must_be_divided():
    assert ClusterConfig(allocation_nodes=24, cell_nodes=8).num_cells == 3
    with pytest.raises(ConfigError) as e:
        ClusterConfig(allocation_nodes=24, cell_nodes=7)
    assert e.value.key == "cell_nodes" and "24" in str(e.value)


def test_preemption_signal_reaches_the_coordinator_and_no_child():
    """USR2 sent to the process and its child (as Slurm signals a whole step): the event is set, the
    child, started after install and through /bin/sh, lives on. Once the shell runs its sleep, the
    group gets USR2 then TERM: a child that USR2 did not end dies of TERM (a signal that kills is
    acted on at once, and pending signals are taken lowest first: USR2, 12, before TERM, 15)."""
    script = textwrap.dedent("""
        import os, signal, subprocess, sys, time
        from gyre.launch.preempt import PreemptionSignal
        pre = PreemptionSignal(signal.SIGUSR2).install()
        child = subprocess.Popen(["sh", "-c", "sleep 30; true"], start_new_session=True)
        children, deadline = f"/proc/{child.pid}/task/{child.pid}/children", time.monotonic() + 10
        while not any(open(f"/proc/{pid}/comm").read() == "sleep\\n" for pid in open(children).read().split()):
            assert time.monotonic() < deadline, "the shell never ran its sleep"
            time.sleep(0.01)
        os.killpg(child.pid, signal.SIGUSR2)  # the shell and its sleep
        os.kill(os.getpid(), signal.SIGUSR2)
        assert pre.event.wait(5), "signal not seen"
        os.killpg(child.pid, signal.SIGTERM)
        code = child.wait(timeout=10)
        print("alive" if code == -signal.SIGTERM else f"child died ({code})")
    """)
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        env=os.environ | {"PYTHONPATH": os.getcwd()},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "alive"


def test_a_run_submitted_from_inside_a_job_forgets_that_job_but_keeps_the_cluster(monkeypatch):
    for key, value in {"SLURM_ARRAY_JOB_ID": "197", "SLURM_JOB_ID": "198", "SLURM_CONF": "/etc/slurm.conf"}.items():
        monkeypatch.setenv(key, value)
    forget_enclosing_job()
    assert not [k for k in os.environ if k.startswith("SLURM_") and k != "SLURM_CONF"]
    assert os.environ["SLURM_CONF"] == "/etc/slurm.conf"
