"""Local cells: each cell leader a child process of the coordinator, under a fixed CPU quota."""

import os
import subprocess
from pathlib import Path

from gyre.cells.base import BaseCell, CellError, leader_command
from gyre.cells.quota import CpuQuota, make_quota
from gyre.cells.spec import CellSpec
from gyre.common.files import write_private_file
from gyre.common.run_paths import RunPaths
from gyre.common.spawn import spawn_child
from gyre.common.wait import wait_until
from gyre.scheduler.cells import Cell

LOCAL_HOST = "127.0.0.1"
"""Every process of a local run is on this machine: loopback unless cluster.bind_host says otherwise."""


class LocalCell(BaseCell):
    """One cell whose leader is a child process here, its log and spec in the run's `logs`, held to `quota`."""

    def __init__(self, spec: CellSpec, state: Cell, paths: RunPaths, quota: CpuQuota):
        super().__init__(spec, state)
        self.log_path, self.spec_path, self.quota = paths.cell_log(state.index), paths.cell_spec(state.index), quota
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        write_private_file(self.spec_path, self.spec.to_json())
        cmd = leader_command(self.spec_path, self.spec.control)
        self.proc = spawn_child(cmd, self.log_path, env=env, in_child=self._in_quota)

    def _in_quota(self) -> None:
        """In the child before exec: so whatever it starts (an mpiexec's leader, the engine) is in the quota."""
        self.quota.add(os.getpid())

    def ready(self, channel, engine_urls: list[str]) -> None:
        super().ready(channel, engine_urls)
        self.quota.cap()  # its start ran uncapped (gyre.cells.quota)

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise CellError(f"cell {self.index}'s leader exited with code {self.proc.returncode}; log tail:\n{tail}")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.channel is not None:
            self.channel.close()  # the leader sees EOF, stops its engine and exits
        if self.proc is not None and not wait_until(lambda: self.proc.poll() is not None, timeout_s, interval_s=0.1):
            self.proc.kill()
            self.proc.wait()
        self.quota.remove()


class LocalLauncher:
    """Makes local cells: loopback addresses, one cgroup quota of `cpus_per_cell` CPUs per cell."""

    def __init__(self, run_dir: Path, cpus_per_cell: float, bind_host: str | None = None):
        self.run_dir, self.cpus_per_cell = run_dir, cpus_per_cell
        self.host = bind_host or LOCAL_HOST
        self.mechanism = "none"

    def proxy_host(self, configured: str) -> str:
        """The proxy binds what proxy.host says: every caller is on this machine."""
        return configured

    def make_cell(self, spec: CellSpec, state: Cell) -> LocalCell:
        quota = make_quota(f"gyre-{os.getpid()}-cell{state.index}", self.cpus_per_cell, state.index, capped=False)
        self.mechanism = quota.mechanism
        return LocalCell(spec, state, RunPaths(self.run_dir), quota)

    def describe(self) -> dict:
        """How cells were placed, for the run's summary."""
        return {"mechanism": self.mechanism, "cpus_per_cell": self.cpus_per_cell}
