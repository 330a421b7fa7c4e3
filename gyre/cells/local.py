"""The coordinator's side of local cells: spawn each cell leader, hold its channel and role state.

A cell's role state machine (`gyre.scheduler.cells.Cell`) lives here, advanced by the phases its
leader reports, so the policy always sees what the cell is really doing.
"""

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gyre.cells.quota import CpuQuota
from gyre.cells.spec import CellSpec
from gyre.control.messages import PhaseDone, RoleSwitch
from gyre.control.transport import Channel, ChannelTimeout
from gyre.errors import GyreError
from gyre.common.serve import die_with_parent
from gyre.scheduler.cells import Cell, Role


class CellError(GyreError):
    """A cell leader died or failed to start; carries the tail of its log."""


@dataclass
class LocalCell:
    """One cell: its leader process, channel, quota and role state."""

    spec: CellSpec
    state: Cell
    log_path: Path
    quota: CpuQuota
    proc: subprocess.Popen | None = None
    channel: Channel | None = None
    engine_url: str = ""
    engine_version: int = -1
    """Weight version its engine serves (after the last load or push)."""

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def engine_id(self) -> str:
        return f"cell{self.index}"

    def start(self) -> None:
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "gyre.cells.leader", self.spec.to_json()], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        self.quota.add(self.proc.pid)

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise CellError(f"cell {self.index}'s leader exited with code {self.proc.returncode}; log tail:\n{tail}")

    def begin_switch(self, target: Role, now_s: float, weights: dict | None, core_address: str) -> None:
        """Start a role switch: the state machine first (it refuses what is not allowed), then the leader."""
        self.state.begin_switch(target, now_s)
        if target == Role.ROLLOUT and weights is not None:
            self.engine_version = weights["version"]  # what its engine loads in the switch's load_weights phase
        self.channel.send(RoleSwitch(self.index, target.value, weights, core_address))

    def messages(self) -> list:
        """What the leader sent since the last call (non-blocking)."""
        out = []
        while True:
            try:
                out.append(self.channel.recv(timeout_s=0))
            except ChannelTimeout:
                return out

    def on_phase(self, msg: PhaseDone, now_s: float) -> None:
        """A phase of the switch is over: the state machine moves to the next (or to the new role)."""
        self.state.next_phase(now_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.channel is not None:
            self.channel.close()  # the leader sees EOF, stops its engine and exits
        if self.proc is not None and self.proc.poll() is None:
            deadline = time.monotonic() + timeout_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self.quota.remove()
