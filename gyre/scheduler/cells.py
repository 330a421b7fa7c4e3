"""Cells and their role state machine: ROLLOUT, TRAIN, the two switching states with their phases, LOST.

A switch is not instantaneous; it walks through named phases that the live cell leader times and
the simulator charges (a share of the configured switch cost each):

    ROLLOUT --begin_switch(TRAIN)--> TO_TRAIN: stop_admission -> hand_off_sessions (proxy reroute +
        KV migration) -> release_engine_memory -> onload_trainer (its state back on the device) ->
        pull_weights (from the core) -> join_step --> TRAIN
    TRAIN --begin_switch(ROLLOUT)--> TO_ROLLOUT: finish_microstep (finish or hand back) ->
        offload_trainer (its state to host memory) -> load_weights (the engine takes its memory
        back, newest version into it) -> announce_to_proxy --> ROLLOUT
    any --lose()--> LOST (terminal)

The core cell owns the authoritative weights and optimizer state: it may never leave a training
step it is part of (`step` is set), so `begin_switch` refuses that instead of corrupting the step.
"""

from dataclasses import dataclass
from enum import Enum

from gyre.errors import GyreError


class SchedulerError(GyreError):
    """A scheduling action that would break an invariant (the caller's bug, not bad config)."""


class TransitionError(SchedulerError):
    """A cell was asked for a role transition its state machine does not allow."""


class Role(str, Enum):
    ROLLOUT = "rollout"
    TRAIN = "train"
    TO_TRAIN = "to_train"
    TO_ROLLOUT = "to_rollout"
    LOST = "lost"


class Phase(str, Enum):
    STOP_ADMISSION = "stop_admission"
    HAND_OFF_SESSIONS = "hand_off_sessions"
    RELEASE_ENGINE_MEMORY = "release_engine_memory"
    PULL_WEIGHTS = "pull_weights"
    JOIN_STEP = "join_step"
    FINISH_MICROSTEP = "finish_microstep"
    OFFLOAD_TRAINER = "offload_trainer"
    ONLOAD_TRAINER = "onload_trainer"
    LOAD_WEIGHTS = "load_weights"
    ANNOUNCE_TO_PROXY = "announce_to_proxy"


PHASES: dict[Role, tuple[Phase, ...]] = {
    Role.TO_TRAIN: (
        Phase.STOP_ADMISSION,
        Phase.HAND_OFF_SESSIONS,
        Phase.RELEASE_ENGINE_MEMORY,
        Phase.ONLOAD_TRAINER,
        Phase.PULL_WEIGHTS,
        Phase.JOIN_STEP,
    ),
    Role.TO_ROLLOUT: (Phase.FINISH_MICROSTEP, Phase.OFFLOAD_TRAINER, Phase.LOAD_WEIGHTS, Phase.ANNOUNCE_TO_PROXY),
}
"""Phases of each switching state, in order."""

PHASE_SHARES: dict[Phase, float] = {
    Phase.STOP_ADMISSION: 0.0,
    Phase.HAND_OFF_SESSIONS: 0.35,
    Phase.RELEASE_ENGINE_MEMORY: 0.15,
    Phase.PULL_WEIGHTS: 0.4,
    Phase.JOIN_STEP: 0.1,
    Phase.FINISH_MICROSTEP: 0.0,
    Phase.OFFLOAD_TRAINER: 0.0,
    Phase.ONLOAD_TRAINER: 0.0,
    Phase.LOAD_WEIGHTS: 0.7,
    Phase.ANNOUNCE_TO_PROXY: 0.3,
}
"""Assumed split of a switch's total cost among its phases (the seed reports only totals; the live
system measures each phase). finish_microstep costs whatever remains of the micro-step; moving the
trainer's state off and back onto the device is not in the seed's totals (0 unless calibrated:
`phase_s`)."""

_TARGET = {Role.TO_TRAIN: Role.TRAIN, Role.TO_ROLLOUT: Role.ROLLOUT}
_START = {Role.TRAIN: (Role.ROLLOUT, Role.TO_TRAIN), Role.ROLLOUT: (Role.TRAIN, Role.TO_ROLLOUT)}


@dataclass
class Cell:
    """A group of nodes acting as a unit; mutated only through its transition methods."""

    index: int
    num_nodes: int
    is_core: bool = False
    role: Role = Role.ROLLOUT
    phase: Phase | None = None
    since_s: float = 0.0
    """When the current role or switching state began, seconds."""
    step: int | None = None
    """The training step this cell is part of (the core: from the step's first micro-step until
    its optimizer step is applied)."""

    def begin_switch(self, target: Role, now_s: float) -> Phase:
        """Start switching to `target` (ROLLOUT or TRAIN); returns the first phase.

        Raises:
            TransitionError: the cell is lost, already there or switching, or it is the core
                and part of a step.
        """
        if target not in _START or self.role != _START[target][0]:
            raise TransitionError(f"cell {self.index}: cannot switch {self.role.value} -> {target.value}")
        if self.is_core and self.step is not None:
            raise TransitionError(f"cell {self.index} is the core and part of step {self.step}; it cannot leave it")
        self.role = _START[target][1]
        self.phase = PHASES[self.role][0]
        self.since_s = now_s
        return self.phase

    def next_phase(self, now_s: float) -> Phase | None:
        """Finish the current phase; returns the next one, or None once the cell holds its new role.

        Raises:
            TransitionError: the cell is not switching.
        """
        if self.phase is None or self.role not in PHASES:
            raise TransitionError(f"cell {self.index} is not switching (role {self.role.value})")
        phases = PHASES[self.role]
        i = phases.index(self.phase)
        if i + 1 < len(phases):
            self.phase = phases[i + 1]
            return self.phase
        self.role = _TARGET[self.role]
        self.phase = None
        self.since_s = now_s
        return None

    def join_step(self, step: int) -> None:
        """Mark the cell part of training step `step` (it claimed one of its micro-steps)."""
        if self.role not in (Role.TRAIN, Role.TO_ROLLOUT):
            raise TransitionError(f"cell {self.index} cannot train step {step} in role {self.role.value}")
        self.step = step

    def leave_step(self) -> None:
        """The cell is no longer part of a step (the optimizer step was applied, or it handed back)."""
        self.step = None

    def lose(self, now_s: float) -> None:
        """The cell stopped answering; it never comes back in this run."""
        self.role = Role.LOST
        self.phase = None
        self.step = None
        self.since_s = now_s

    @property
    def serving(self) -> bool:
        """Whether this cell admits and serves rollout sessions now."""
        return self.role == Role.ROLLOUT


def make_cells(num_cells: int, cell_nodes: int) -> list[Cell]:
    """Cells 0..num_cells-1 of `cell_nodes` nodes each; cell 0 is the core."""
    return [Cell(index=i, num_nodes=cell_nodes, is_core=(i == 0)) for i in range(num_cells)]
