"""Messages between the coordinator and cell leaders (frozen dataclasses, one per verb).

    coordinator ──SwitchRole / TrainStep / SaveCheckpoint / Stop──> cell leader
    cell leader ──CellReady / PhaseDone / RoleDone / StepDone / CheckpointDone / CellFailure──> coordinator

Only the core cell receives TrainStep and SaveCheckpoint. Satellites never get batches from the
coordinator: they claim micro-steps from the core (gyre.train.elastic).
"""

import pickle
from dataclasses import dataclass, field

from gyre.trajectory.sample import PackedBatch


@dataclass(frozen=True)
class SwitchRole:
    target: str
    """"train" or "rollout" (gyre.scheduler.cells.Role values)."""
    weights: dict | None = None
    """The newest published weights (descriptor + version) an engine returning to rollout loads."""
    core_address: str = ""
    """Where a satellite joining training finds the core (gyre.train.elastic.CoreServer.address)."""


@dataclass(frozen=True)
class TrainStep:
    step: int
    batches: list[PackedBatch]
    total_weight: float
    """Summed loss weight of the step's targets: the loss normaliser."""


@dataclass(frozen=True)
class SaveCheckpoint:
    step: int
    extra: dict = field(default_factory=dict)
    """The coordinator's state saved beside the trainer's (data cursor, ...)."""


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class CellReady:
    cell: int
    engine_url: str
    core_address: str = ""
    """The core's satellite address ("" from satellites)."""
    weights: dict | None = None
    """The core: its initial weights as published (version 0 or the checkpoint's)."""
    step: int = 0
    """The core: the trainer's step (weight version) after loading."""
    weights_digest: str = ""
    """The core: digest of its flat weights (a resumed run shows it equals the checkpoint's)."""


@dataclass(frozen=True)
class PhaseDone:
    cell: int
    phase: str
    seconds: float


@dataclass(frozen=True)
class RoleDone:
    cell: int
    role: str
    t_start: float
    phases: dict[str, float]
    """Phase -> seconds, in order."""


@dataclass(frozen=True)
class StepDone:
    step: int
    version: int
    """The new weight version (step + 1)."""
    metrics: dict
    weights: dict
    """Descriptor of the published weights (gyre.transfer publish_tensors) + "version"."""
    seconds: float


@dataclass(frozen=True)
class CheckpointDone:
    step: int
    path: str
    seconds: float
    weights_digest: str = ""


@dataclass(frozen=True)
class CellFailure:
    cell: int
    message: str


def send(conn, msg) -> None:
    """Plain pickle (not the Connection's ForkingPickler: its shared-memory tensors need a common parent)."""
    conn.send_bytes(pickle.dumps(msg))


def recv(conn):
    return pickle.loads(conn.recv_bytes())
