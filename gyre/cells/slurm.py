"""Slurm cells: each cell leader runs in a task of the run's heterogeneous job, component k+1 for cell k.

    gyre-train ─submitit─> het job, one step over every component (gyre.launch.job)
      component 0, rank 0: coordinator ─ listener on its node ─ writes CellSpec k  ─┐
      component k+1, rank 0: waits for its CellSpec ─ binds its own node ─ CellLeader ─connect─> CellReady
      component k+1, ranks > 0: return at once (the tiny model's cell is one process)

The leaders are started by Slurm together with the coordinator, so `SlurmCell.start` hands a
leader its spec through the job directory (shared file system, like submitit's own pickles): the
spec carries the listener's address and key, so the file is private to the user. Spec and status
files are named by the job's restart count, so a requeued job's tasks never read the previous
run's. A leader that fails leaves its traceback in a `.failed` file, which `check_alive` reports.
"""

import dataclasses
import logging
import signal
import socket
import subprocess
import time
import traceback
from pathlib import Path

from gyre.cells.base import BaseCell, CellError, leader_command
from gyre.cells.placement import SlurmPlacement
from gyre.cells.spec import CellSpec
from gyre.common.files import write_private_file
from gyre.scheduler.cells import Cell

log = logging.getLogger(__name__)


def spec_path(job_dir: Path, cell: int, restart: int) -> Path:
    return job_dir / f"cell{cell}.r{restart}.json"


def failed_path(job_dir: Path, cell: int, restart: int) -> Path:
    return job_dir / f"cell{cell}.r{restart}.failed"


def coordinator_exit_path(job_dir: Path, restart: int) -> Path:
    """Written when the coordinator's task ends: leaders still waiting for a spec stop waiting."""
    return job_dir / f"coordinator.r{restart}.exit"


def node_address(placement: SlurmPlacement, bind_host: str | None) -> str:
    """The address this task's servers bind and advertise: `bind_host`, else its node's name resolved."""
    return bind_host or socket.gethostbyname(placement.node or socket.gethostname())


class SlurmCell(BaseCell):
    """One cell whose leader is the first task of het component `index + 1` of this job."""

    def __init__(self, spec: CellSpec, state: Cell, job_dir: Path, restart: int):
        super().__init__(spec, state)
        self.job_dir, self.restart = job_dir, restart

    def start(self) -> None:
        write_private_file(spec_path(self.job_dir, self.index, self.restart), self.spec.to_json())

    def check_alive(self) -> None:
        failed = failed_path(self.job_dir, self.index, self.restart)
        if failed.exists():
            raise CellError(
                f"cell {self.index}'s leader failed (Slurm component {self.index + 1}):\n"
                f"{failed.read_text(errors='replace')[-3000:]}"
            )

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.channel is not None:
            self.channel.close()  # the leader sees EOF, stops its engine, its task returns


class SlurmLauncher:
    """Makes the cells of the het job this coordinator runs in (component 0)."""

    def __init__(self, job_dir: Path, placement: SlurmPlacement, bind_host: str | None):
        self.job_dir, self.placement = job_dir, placement
        self.host = node_address(placement, bind_host)

    def proxy_host(self, configured: str) -> str:
        """The proxy binds this node's address: leaders on other nodes call its admin API."""
        return self.host

    def make_cell(self, spec: CellSpec, state: Cell) -> SlurmCell:
        if state.index + 1 >= self.placement.het_size:
            raise CellError(
                f"cell {state.index} has no component: the job has {self.placement.het_size} "
                "(cluster.num_cells changed after submission?)"
            )
        return SlurmCell(spec, state, self.job_dir, self.placement.restart_count)

    def describe(self) -> dict:
        """How cells were placed, for the run's summary."""
        return {"mechanism": "slurm", "job_id": self.placement.job_id, "restart_count": self.placement.restart_count}


def run_cell_task(job_dir: Path, placement: SlurmPlacement, bind_host: str | None, timeout_s: float) -> None:
    """A cell component's first task: runs the cell's leader once the coordinator wrote its spec.

    Raises:
        CellError: no spec within `timeout_s` (the coordinator failed first, or never started).
    """
    # Slurm signals every process of the step (scancel -s USR2, --signal before the time limit):
    # only the coordinator acts on it; the leader and its engine ignore it, children inherit that.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    cell, restart = placement.het_group - 1, placement.restart_count
    try:
        spec = _wait_for_spec(job_dir, cell, restart, timeout_s)
        host = node_address(placement, bind_host)
        spec = dataclasses.replace(spec, host=host, engine=dataclasses.replace(spec.engine, host=host))
        Path(spec.run_dir).mkdir(parents=True, exist_ok=True)
        log.warning(
            "cell %d: leader on %s (%s), restart %d, control %s", cell, placement.node, host, restart, spec.control
        )
        if spec.control == "mpi":  # an MPI process of its own, under mpiexec on this node
            rc = subprocess.run(leader_command(spec)).returncode
            if rc != 0:
                raise CellError(f"cell {cell}: its leader under mpiexec exited with code {rc}")
            return
        from gyre.cells.leader import CellLeader

        CellLeader(spec).run()
    except BaseException:
        write_private_file(failed_path(job_dir, cell, restart), f"on node {placement.node}:\n{traceback.format_exc()}")
        raise


def _wait_for_spec(job_dir: Path, cell: int, restart: int, timeout_s: float) -> CellSpec:
    path, deadline = spec_path(job_dir, cell, restart), time.monotonic() + timeout_s
    while not path.exists():
        if coordinator_exit_path(job_dir, restart).exists():
            raise CellError(f"cell {cell}: the coordinator ended before it started this cell")
        if time.monotonic() > deadline:
            raise CellError(f"cell {cell}: no spec at {path} after {timeout_s} s (coordinator.cell_start_timeout_s)")
        time.sleep(0.2)
    return CellSpec.from_json(path.read_text())
