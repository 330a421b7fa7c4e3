"""What the coordinator holds for one cell, whatever runs it: the interface LocalCell and SlurmCell share.

A cell's role state machine (`gyre.scheduler.cells.Cell`) lives here, advanced by the phases its
leader reports, so the policy always sees what the cell is really doing. Backends differ only in
how the leader process is started, watched and stopped (`start`, `check_alive`, `stop`); the
channel and the role protocol are the same for all.
"""

import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Protocol

from gyre.cells.serving import engine_id
from gyre.cells.spec import CellSpec
from gyre.common.wait import wait_until
from gyre.control.messages import PhaseDone, RoleSwitch
from gyre.control.transport import Channel, ChannelClosed, ChannelTimeout
from gyre.engines.launch import BaseEngineProcess, attach_engine
from gyre.engines.published import PublishedWeights
from gyre.errors import GyreError
from gyre.scheduler.cells import Cell, Role


class CellError(GyreError):
    """A cell leader died or failed to start; carries what its backend knows (a log tail, a job's state)."""


def leader_command(spec_file: str | Path, control: str) -> list[str]:
    """The command line of a cell leader, its CellSpec in `spec_file` (a private file: the spec holds
    the proxy's admin token). Under the mpi control transport it runs under MPICH's `mpiexec -n 1`
    (two MPICH singletons cannot connect; the fork launcher keeps it on this node even inside a
    Slurm step, where hydra would otherwise launch through srun)."""
    cmd = [sys.executable, "-m", "gyre.cells.leader", str(spec_file)]
    if control == "mpi":
        return [str(Path(sys.executable).with_name("mpiexec")), "-launcher", "fork", "-n", "1", *cmd]
    return cmd


class BaseCell(ABC):
    """One cell as the coordinator sees it: its leader's channel, engine and role state."""

    def __init__(self, spec: CellSpec, state: Cell):
        self.spec, self.state = spec, state
        self.channel: Channel | None = None
        self.engines: list[BaseEngineProcess] = []
        """Handles on its engines (CellReady's order; gyre.cells.serving): their backend's verbs at
        their URLs (gyre.engines.launch.attach_engine); the leader runs them."""

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def engine_ids(self) -> list[str]:
        """The proxy's names of its engines, all registered under its index."""
        return [engine_id(self.index, j) for j in range(len(self.engines))]

    @property
    def engine_urls(self) -> list[str]:
        return [engine.url for engine in self.engines]

    @abstractmethod
    def start(self) -> None:
        """Have the leader started; it connects to `spec.coordinator_address` and says CellReady."""

    def ready(self, channel: Channel, engine_urls: list[str]) -> None:
        """The leader said CellReady on `channel`: the cell runs from here."""
        self.channel = channel
        self.engines = [attach_engine(self.spec.engine, self.spec.model, url) for url in engine_urls]

    @abstractmethod
    def check_alive(self) -> None:
        """Raise CellError if the leader is known to have died."""

    @abstractmethod
    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the leader (its engine with it) and release what `start` took; idempotent."""

    def begin_switch(self, target: Role, now_s: float, weights: PublishedWeights | None, core_address: str) -> None:
        """Start a role switch: the state machine first (it refuses what is not allowed), then the leader."""
        self.state.begin_switch(target, now_s)
        self.channel.send(RoleSwitch(self.index, target.value, weights, core_address))

    def messages(self) -> list:
        """What the leader sent since the last call (non-blocking).

        Raises:
            CellError: the channel closed (the leader died, or its node did).
        """
        out = []
        while True:
            try:
                out.append(self.channel.recv(timeout_s=0))
            except ChannelTimeout:
                return out
            except ChannelClosed as e:
                self._explain_gone()
                raise CellError(f"cell {self.index}'s leader is gone: {e}") from None

    def _explain_gone(self, within_s: float = 3.0) -> None:
        """A backend that knows why the leader went raises that (its exit code, its `.failed` file):
        asked for `within_s`, as the channel closes before a dying process can be reaped."""
        wait_until(lambda: self.check_alive(), within_s)  # never true: it raises, or the time runs out

    def on_phase(self, msg: PhaseDone, now_s: float) -> None:
        """A phase of the switch is over: the state machine moves to the next (or to the new role)."""
        self.state.next_phase(now_s)


class CellLauncher(Protocol):
    """Makes a run's cells for one backend (gyre.cells.local.LocalLauncher, gyre.cells.slurm.SlurmLauncher)."""

    host: str
    """Address the coordinator's listener binds and leaders are told (local: loopback; Slurm: this node)."""

    def proxy_host(self, configured: str) -> str:
        """The address the proxy binds, given `proxy.host`."""

    def make_cell(self, spec: CellSpec, state: Cell) -> BaseCell:
        """The cell for `spec` (not started)."""

    def describe(self) -> dict:
        """How cells were placed, for the run's summary (`cpu_quota`)."""
