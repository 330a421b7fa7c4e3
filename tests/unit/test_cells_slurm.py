"""The coordinator's side of Slurm cells and a cell task's wait for its spec, without a cluster:
spec files are private and per restart, failures and an ended coordinator are reported, not waited out."""

import contextlib
import dataclasses
import os
import signal
import socket
import stat
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gyre.cells.base import CellError, leader_command
from gyre.cells.placement import SlurmPlacement
from gyre.cells.slurm import (
    SlurmCell,
    SlurmLauncher,
    _node_engines,
    coordinator_exit_path,
    engine_path,
    failed_path,
    run_cell_task,
    spec_path,
)
from gyre.cells.spec import CellSpec
from gyre.common.files import write_private_file
from gyre.engines.config import EngineConfig
from gyre.models.config import ModelConfig
from gyre.scheduler.cells import make_cells
from gyre.train.config import TrainerConfig


@pytest.fixture(autouse=True)
def _keep_usr2():
    """run_cell_task ignores USR2 for its process (here: pytest's); put it back."""
    before = signal.getsignal(signal.SIGUSR2)
    yield
    signal.signal(signal.SIGUSR2, before)


def _spec(index: int) -> CellSpec:
    return CellSpec(
        index=index,
        role="rollout",
        model=ModelConfig(),
        trainer=TrainerConfig(),
        engine=EngineConfig(),
        seed=0,
        host="127.0.0.1",
        coordinator_address="tcp://127.0.0.1:1/00",
        proxy_url="http://x",
        proxy_admin_token="secret",
        checkpoint_dir="/nonexistent",
        run_dir="/nonexistent",
    )


def _placement(het_group: int, restart: int = 0, het_size: int = 3, rank: int = 0, tasks: int = 1) -> SlurmPlacement:
    node = f"n{het_group + 1}"
    return SlurmPlacement("7", het_group, 3, het_group, het_size, rank, node, node, restart, group_tasks=tasks)


def test_start_writes_a_private_spec_for_this_restart(tmp_path):
    state = make_cells(2, 1)[1]
    SlurmCell(_spec(1), state, tmp_path, restart=2).start()
    path = spec_path(tmp_path, 1, 2)
    assert CellSpec.from_json(path.read_text()) == _spec(1)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600, "it carries the listener's key and the admin token"


def test_check_alive_reports_the_leaders_traceback(tmp_path):
    cell = SlurmCell(_spec(1), make_cells(2, 1)[1], tmp_path, restart=0)
    cell.check_alive()
    failed_path(tmp_path, 1, 0).write_text("Traceback: boom")
    with pytest.raises(CellError, match="boom"):
        cell.check_alive()


def test_a_follower_rank_that_fails_is_the_cells_failure(tmp_path):
    """A component with other tasks than the spec's ranks (the config changed after submission) fails
    each rank in its own file, and check_alive reports any of them."""
    write_private_file(spec_path(tmp_path, 1, 0), dataclasses.replace(_spec(1), ranks=2).to_json())
    with pytest.raises(CellError, match="runs 3 tasks, its spec has 2 ranks"):
        run_cell_task(tmp_path, _placement(2, rank=1, tasks=3), "127.0.0.1", timeout_s=5)
    assert not failed_path(tmp_path, 1, 0).exists() and "rank 1" in failed_path(tmp_path, 1, 0, rank=1).read_text()
    with pytest.raises(CellError, match="rank1.failed"):
        SlurmCell(_spec(1), make_cells(2, 1)[1], tmp_path, restart=0).check_alive()


def test_a_rank_exports_its_planned_local_rank_and_is_refused_where_srun_placed_it_elsewhere(tmp_path, monkeypatch):
    """Rank 1 of a cell of 2 nodes x 2 ranks is task 1 of node 0 (block placement): LOCAL_RANK=1 is its
    CUDA device; srun's cyclic distribution would make it task 0 of node 1, which is refused."""
    from gyre.cells import slurm

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    spec = dataclasses.replace(_spec(1), ranks=4, nodes=2)
    slurm._export_rank_place(spec, dataclasses.replace(_placement(2, rank=1, tasks=4), local_id=1))
    assert os.environ["LOCAL_RANK"] == "1"
    from gyre.train import model

    monkeypatch.setattr(model.torch.cuda, "device_count", lambda: 2)
    assert model.local_device(rank=1) == 1  # the trainer's CUDA device is the planned one
    monkeypatch.setattr(model.torch.cuda, "device_count", lambda: 1)  # a site binding one GPU per task
    with pytest.raises(model.ParallelError, match="all of the node's GPUs"):
        model.local_device(rank=1)
    with pytest.raises(CellError, match="distribution=block"):
        slurm._export_rank_place(spec, dataclasses.replace(_placement(2, rank=1, tasks=4), local_id=0))


def test_a_rank_watches_the_engines_it_started_until_one_exits_or_it_stops():
    """An engine a rank started that exits is found (the rank then exits: the cell is lost, for a
    follower on Slurm and for rank 0 anywhere); once the rank is stopping, its engines' exit (their
    stop) is no loss."""
    from gyre.common.serve import first_exited

    def engine(codes):
        return SimpleNamespace(proc=SimpleNamespace(poll=lambda: next(codes)))

    alive, dies = engine(iter(lambda: None, 0)), engine(iter([None, None, -9]))
    assert first_exited([alive, dies], threading.Event(), every_s=0.001) is dies
    stopping = threading.Event()
    stopping.set()
    assert first_exited([alive, engine(iter(lambda: -15, 0))], stopping, every_s=0.001) is None


def test_launcher_refuses_a_cell_without_a_component(tmp_path):
    launcher = SlurmLauncher(tmp_path, _placement(0, het_size=2), bind_host="127.0.0.1")
    assert launcher.make_cell(_spec(0), make_cells(2, 1)[0]).spec.followers_placed  # srun runs every rank
    with pytest.raises(CellError, match="no component"):
        launcher.make_cell(_spec(1), make_cells(2, 1)[1])


def test_a_cell_task_stops_waiting_once_the_coordinator_ended(tmp_path):
    coordinator_exit_path(tmp_path, 1).touch()
    t0 = time.monotonic()
    with pytest.raises(CellError, match="coordinator ended"):
        run_cell_task(tmp_path, _placement(2, restart=1), "127.0.0.1", timeout_s=60)
    assert time.monotonic() - t0 < 5
    assert "coordinator ended" in failed_path(tmp_path, 1, 1).read_text()


def test_a_cell_task_ignores_the_previous_runs_spec(tmp_path):
    (tmp_path / "cell0.r0.json").write_text(_spec(0).to_json())  # the run before the requeue
    with pytest.raises(CellError, match="no spec"):
        run_cell_task(tmp_path, _placement(1, restart=1), "127.0.0.1", timeout_s=0.5)


def test_an_mpi_leader_runs_under_mpiexec_on_its_own_node_and_a_tcp_one_plainly():
    assert leader_command("/run/cell1.spec.json", "tcp")[1:] == ["-m", "gyre.cells.leader", "/run/cell1.spec.json"]
    cmd = leader_command("/run/cell1.spec.json", "mpi")
    assert Path(cmd[0]).name == "mpiexec" and cmd[1:5] == ["-launcher", "fork", "-n", "1"]
    assert cmd[6:] == ["-m", "gyre.cells.leader", "/run/cell1.spec.json"]  # the spec (a token in it) is not on argv


def test_a_server_spanning_two_nodes_is_started_by_each_nodes_first_rank_with_node_rank_0s_rendezvous(tmp_path):
    """engine.tp_size=4 on nodes of 2 ranks (engine.nnodes=2): rank 0 starts node rank 0, advertised at
    its node's address (bind_host 0.0.0.0 kept for --host) and publishes the rendezvous; rank 2, the
    other node's first rank, starts node rank 1 with it; ranks 1 and 3 start nothing."""
    sglang = EngineConfig(
        backend="sglang", model_path="/m", enable_hicache=False, weight_sync="disk", tp_size=4, nnodes=2
    )
    spec = dataclasses.replace(_spec(1), ranks=4, nodes=2, engine=dataclasses.replace(sglang, bind_host="0.0.0.0"))
    with contextlib.ExitStack() as held:
        ((head, gpu),) = _node_engines(tmp_path, 0, spec, 0, "127.0.0.1", 5, held)
        assert (head.host, head.listen_host, head.nnodes, head.node_rank, gpu) == ("127.0.0.1", "0.0.0.0", 2, 0, 0)
        assert head.dist_init_addr.startswith("127.0.0.1:")
        port = int(head.dist_init_addr.rsplit(":", 1)[1])
        with socket.socket() as other_bind, pytest.raises(OSError):  # reserved until its engine started
            other_bind.bind(("127.0.0.1", port))
        ((other, _),) = _node_engines(tmp_path, 0, spec, 2, "127.0.0.2", 5, held)
        assert (other.host, other.node_rank, other.dist_init_addr) == ("127.0.0.2", 1, head.dist_init_addr)
        assert _node_engines(tmp_path, 0, spec, 1, "127.0.0.1", 5, held) == []
        assert _node_engines(tmp_path, 0, spec, 3, "x", 5, held) == []
        assert stat.S_IMODE(engine_path(tmp_path, 1, 0, 0).stat().st_mode) == 0o600  # beside the spec, as private
        with pytest.raises(CellError, match="no engine rendezvous"):  # node rank 0's never published
            _node_engines(tmp_path, 1, spec, 2, "127.0.0.2", 0.3, held)
