"""Pure launch helpers: placement from Slurm variables, and the het-job plan rendered for submitit."""

import pytest

from gyre.launch.config import ClusterConfig
from gyre.launch.environment import NotInSlurmJob, parse_placement
from gyre.launch.slurm import make_cell_components, make_hetjob_parameters

# Variables as Slurm 22.05 set them in a step `srun --het-group=0,1` over components of 2 and 1 nodes.
HET_STEP = {
    "SLURM_JOB_ID": "3", "SLURM_NTASKS": "3", "SLURM_HET_SIZE": "2",
    "SLURM_NTASKS_HET_GROUP_0": "2", "SLURM_NTASKS_HET_GROUP_1": "1",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "n[1-2]", "SLURM_JOB_NODELIST_HET_GROUP_1": "n3",
    "SLURM_JOB_NODELIST": "n[1-3]",
}


@pytest.mark.parametrize(
    "env, expected",
    [
        pytest.param(
            {"SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[4-5]",
             "SLURMD_NODENAME": "n5"},
            dict(het_group=0, het_size=1, group_rank=1, group_nodes="n[4-5]", node="n5"),
            id="plain-job",
        ),
        pytest.param({**HET_STEP, "SLURM_PROCID": "0", "SLURMD_NODENAME": "n1"},
                     dict(het_group=0, het_size=2, group_rank=0, group_nodes="n[1-2]", node="n1"), id="het-first"),
        pytest.param({**HET_STEP, "SLURM_PROCID": "1", "SLURMD_NODENAME": "n2"},
                     dict(het_group=0, het_size=2, group_rank=1, group_nodes="n[1-2]", node="n2"), id="het-first-rank1"),
        pytest.param({**HET_STEP, "SLURM_PROCID": "2", "SLURMD_NODENAME": "n3"},
                     dict(het_group=1, het_size=2, group_rank=0, group_nodes="n3", node="n3"), id="het-second"),
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
    cluster = ClusterConfig(num_cells=3, cell_nodes=2, cpus_per_node=4, mem_gb_per_node=16, gpus_per_node=8,
                            partition="gpu", sbatch_extra=["--constraint=h200"])
    params = make_hetjob_parameters(cluster, make_cell_components(cluster))
    assert params["nodes"] == 2 and params["gpus_per_node"] == 8 and params["slurm_partition"] == "gpu"
    assert params["slurm_srun_args"] == ["--het-group=0,1,2"]
    assert params["slurm_additional_parameters"] == {"constraint": "h200"}
    block = ["#SBATCH hetjob", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=4",
             "#SBATCH --mem=16G", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
             "#SBATCH --constraint=h200"]
    assert params["slurm_setup"] == block * 2


def test_single_cell_is_a_plain_job():
    params = make_hetjob_parameters(ClusterConfig(num_cells=1), make_cell_components(ClusterConfig(num_cells=1)))
    assert params["slurm_setup"] == [] and params["slurm_srun_args"] == []
