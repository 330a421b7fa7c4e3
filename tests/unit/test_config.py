"""The config tree composes against the structured schema and rejects what cannot run, naming the key."""

import os
import subprocess
import sys

import hydra
import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from gyre.common import CONF_DIR
from gyre.config import register_configs, validate
from gyre.coordinator.config import LOCAL_RESERVE_CPUS, GyreConfig
from gyre.errors import ConfigError

register_configs()


def compose(*overrides: str):
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra.compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param((), id="defaults"),
        pytest.param(("cluster=slurm",), id="slurm-preset-of-48-node-cells"),
        pytest.param(("scheduler=async",), id="async"),
        pytest.param(("scheduler=colocate", "scheduler.staleness=0"), id="colocate-on-policy"),
        pytest.param(("+experiment=smoke",), id="smoke-preset"),
    ],
)
def test_valid_configs_compose_and_validate(overrides):
    assert isinstance(validate(compose(*overrides)), GyreConfig)


@pytest.mark.parametrize(
    "override, key",
    [
        pytest.param("cluster.cell_nodes=0", "cluster.cell_nodes", id="zero-cell-nodes"),
        pytest.param("cluster.num_cells=0", "cluster.num_cells", id="no-cells"),
        pytest.param("cluster.backend=k8s", "cluster.backend", id="unknown-backend"),
        pytest.param("scheduler.staleness=-1", "scheduler.staleness", id="negative-staleness"),
        pytest.param("scheduler.mode=sync", "scheduler.mode", id="unknown-mode"),
        pytest.param("num_steps=0", "num_steps", id="no-steps"),
        pytest.param("proxy.fsync_window_ms=-1", "proxy.fsync_window_ms", id="negative-fsync-window"),
        pytest.param("coordinator.group_size=1", "coordinator.group_size", id="group-of-one"),
        pytest.param("mode=debug", "mode", id="unknown-run-mode"),
        pytest.param("proxy.context_len=100000", "proxy.context_len", id="context-beyond-the-model"),
        pytest.param("cluster.num_cells=64", "cluster.num_cells", id="more-cells-than-cpus"),
        pytest.param("harness.kind=emacs", "harness.kind", id="unknown-harness"),
        pytest.param("harness.isolation=apptainer", "harness.isolation", id="apptainer-isolation-not-built"),
        pytest.param("harness.isolation=enroot", "harness.isolation", id="enroot-isolation-not-built"),
        pytest.param("cluster.control=zmq", "cluster.control", id="unknown-control-transport"),
        pytest.param("cluster.control_peer_timeout_s=0", "cluster.control_peer_timeout_s", id="no-peer-timeout"),
        pytest.param("engine=sglang", "engine.backend", id="sglang-not-installed"),
        pytest.param("cluster.num_cells=1", "cluster.num_cells", id="one-cell-cannot-serve-and-train"),
        pytest.param("scheduler.microstep_tokens=4096", "scheduler.microstep_tokens", id="sim-only-microsteps"),
        pytest.param("scheduler.admission=staleness", "scheduler.admission", id="sim-only-admission"),
        pytest.param("scheduler.batching=first_ready", "scheduler.batching", id="sim-only-batching"),
        pytest.param("proxy.kv_move_timeout_s=55", "proxy.kv_move_timeout_s", id="hand-off-past-admin-timeout"),
        pytest.param("coordinator.decode_window_s=0", "coordinator.decode_window_s", id="no-decode-window"),
    ],
)
def test_bad_values_name_their_key(override, key):
    with pytest.raises(ConfigError) as err:
        validate(compose(override))
    assert err.value.key == key


@pytest.mark.parametrize(
    "overrides, key",
    [
        pytest.param(("cluster.ranks_per_node=2",), "cluster.ranks_per_node", id="ranks-per-node-locally"),
        pytest.param(("trainer.tensor_parallel_size=2",), "trainer.tensor_parallel_size", id="tp-over-one-rank"),
        pytest.param(("cluster.ranks_per_cell=0",), "cluster.ranks_per_cell", id="no-ranks"),
        pytest.param(("cluster.cell_nodes=2",), "cluster.cell_nodes", id="local-nodes-without-their-ranks"),
        pytest.param(("cluster=slurm", "cluster.ranks_per_node=1"), "cluster.ranks_per_node", id="idle-gpus"),
        pytest.param(("cluster=slurm", "cluster.ranks_per_node=16"), "cluster.ranks_per_node", id="two-ranks-a-gpu"),
    ],
)
def test_cells_of_several_ranks_are_refused_where_they_are_not_built(overrides, key):
    with pytest.raises(ConfigError) as err:
        validate(compose(*overrides))
    assert err.value.key == key
    alone = ("cluster.num_cells=1", "scheduler=colocate", "cluster.ranks_per_cell=2", "trainer.tensor_parallel_size=2")
    assert validate(compose(*alone)).cluster.ranks_per_cell == 2  # a core training alone is built
    assert validate(compose("cluster.ranks_per_cell=2")).cluster.num_cells >= 2  # and local satellites of 2 ranks
    assert validate(compose("cluster.ranks_per_cell=2", "cluster.cell_nodes=2")).cluster.cell_nodes == 2  # 2 engines
    slurm = validate(compose("cluster=slurm", "cluster.cell_nodes=2", "cluster.gpus_per_node=2"))
    assert slurm.cluster.ranks_per_cell == 4 and slurm.cluster.num_cells == 4  # and satellites of 4 ranks on Slurm
    assert validate(compose("cluster=slurm")).cluster.ranks_per_node == 8  # one rank per GPU by default
    cpu = validate(compose("cluster=slurm", "cluster.gpus_per_node=0", "cluster.ranks_per_node=2"))
    assert cpu.cluster.ranks_per_cell == 96  # a CPU cluster's ranks per node are the user's choice


def test_local_cells_leave_cpu_to_the_processes_outside_them():
    """Cells outweigh everything else (gyre.cells.quota), so cells that take every CPU would starve
    the harnesses, the proxy and the coordinator: refused, naming the key."""
    have = len(os.sched_getaffinity(0))
    fits = (have - LOCAL_RESERVE_CPUS) / 3
    assert isinstance(validate(compose("cluster.num_cells=3", f"coordinator.cpus_per_cell={fits}")), GyreConfig)
    with pytest.raises(ConfigError) as err:
        validate(compose("cluster.num_cells=3", f"coordinator.cpus_per_cell={have / 3}"))
    assert err.value.key == "cluster.num_cells" and "the harnesses, the proxy and the coordinator" in str(err.value)


def test_unknown_key_and_wrong_type_fail_at_composition():
    with pytest.raises(ConfigCompositionException, match="bogus"):
        compose("cluster.bogus=1")
    with pytest.raises(ConfigCompositionException) as err:
        compose("cluster.cell_nodes=many")
    assert isinstance(err.value.__cause__, (ValidationError, ConfigKeyError))


def _gyre_train(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from gyre.launch.train import main; main()", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_cli_unknown_group_option_lists_the_valid_ones():
    out = _gyre_train("scheduler=foo", "--cfg", "job")
    assert out.returncode != 0
    for word in ("scheduler", "elastic", "async", "colocate"):
        assert word in out.stderr


def test_cli_cfg_job_prints_only_validated_configs():
    bad = _gyre_train("cluster.cell_nodes=0", "--cfg", "job")
    assert bad.returncode != 0 and "cluster.cell_nodes" in bad.stderr
    good = _gyre_train("scheduler=colocate", "--cfg", "job")
    assert good.returncode == 0 and "mode: colocate" in good.stdout


def test_cli_run_with_more_cells_than_the_machine_fails_before_starting_anything(tmp_path):
    out = _gyre_train(f"hydra.run.dir={tmp_path}", "cluster.num_cells=64")
    assert out.returncode != 0 and "cluster.num_cells" in out.stderr and "CPUs" in out.stderr
    assert not (tmp_path / "ledger.jsonl").exists()


def test_cli_sglang_engine_without_sglang_is_refused_before_starting_anything(tmp_path):
    """Where sglang cannot be imported (and no fake is configured) engine=sglang must stop the run
    with the install hint, not serve with another engine."""
    out = _gyre_train(f"hydra.run.dir={tmp_path}", "engine=sglang")
    assert out.returncode != 0 and "engine.backend" in out.stderr and "pip install 'gyre[sglang]'" in out.stderr
    assert not (tmp_path / "ledger.jsonl").exists()


def test_submitit_launcher_plugin_composes():
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hydra.compose(config_name="config", overrides=["hydra/launcher=submitit_slurm"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
