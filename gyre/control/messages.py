"""Typed control messages: what cells, the core and the coordinator say to each other (small; bulk
bytes go over Mooncake).

Every message is a frozen dataclass registered in `MESSAGES`; its fields are type-checked when it
is built and again when it arrives (`check`), so a peer that sends something else gets a clear
`ProtocolError` instead of an AttributeError deep inside a server thread.

    satellite <-> core (gyre/train/elastic.py)
      Join(cell, signature, ranks, tp) -> Welcome(...) | Refused(reason)
      Claim(cell) -> Work(index, version, slot, batch) | Wait() | Evicted()
      Done(index, stats, seconds, rank, replica)   the gradient is in the slot
      Pull(cell) -> WeightVersion(version)    weights stay at `version` until PullDone(cell)
      Leave(cell)
    coordinator <-> cell leader (gyre/coordinator, gyre/cells)
      CellReady(cell, engine_urls, ...)       once the leader's trainer and engines are up
      RoleSwitch(cell, target, ...) -> PhaseDone(cell, phase, seconds)... -> RoleDone(cell, role, ...)
      MicroBatches(step, group, batches)... EndStep(step) -> StepProgress(step, done)... -> StepDone(...)
    A micro-batch is known everywhere by its MicroBatchId (step, group, k): the coordinator names
    it, the core (gyre/train/elastic.py) owns the open step and reports trained ids back.
      SaveCheckpoint(step, extra) -> CheckpointDone(...); Stop; Failure(cell, reason)
"""

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field

from gyre.engines.published import PublishedWeights
from gyre.errors import GyreError
from gyre.trajectory.sample import PackedBatch


class ProtocolError(GyreError):
    """A peer sent something that is not a well-formed control message."""


MESSAGES: dict[str, type] = {}
"""Message class name -> class: the only types a channel accepts."""


def message(cls: type) -> type:
    """Declare a control message: a frozen dataclass whose fields are checked against their types."""
    cls.__post_init__ = check  # before dataclass(): its __init__ calls __post_init__ only if present
    cls = dataclass(frozen=True)(cls)
    MESSAGES[cls.__name__] = cls
    return cls


@functools.cache
def _hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _is(value: object, kind: object) -> bool:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return any(_is(value, k) for k in typing.get_args(kind))
    if kind is typing.Any:
        return True
    if kind is type(None):
        return value is None
    cls = origin or kind
    if cls is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if cls is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, cls)


def check(msg: object) -> None:
    """Raise ProtocolError unless `msg` is a registered message whose fields have their declared types."""
    cls = type(msg)
    if MESSAGES.get(cls.__name__) is not cls:
        raise ProtocolError(f"{cls.__module__}.{cls.__qualname__} is not a control message; known: {sorted(MESSAGES)}")
    for f in dataclasses.fields(cls):
        value = getattr(msg, f.name, dataclasses.MISSING)
        if value is dataclasses.MISSING or not _is(value, _hints(cls)[f.name]):
            raise ProtocolError(
                f"{cls.__name__}.{f.name} must be {_hints(cls)[f.name]}, got {type(value).__name__}: {value!r:.80}"
            )


CellId = str | int
"""A cell's name: trainer-side names ("core", "cell2") or the scheduler's cell index."""

MicroBatchId = tuple[int, int, int]
"""(step, group, k): the k-th micro-batch of group `group` trained at step `step`; stable from the
coordinator that cuts it to the core that trains it, so nobody else counts a step's micro-batches."""


# ---- satellite <-> core ---------------------------------------------------------------------
@message
class Join:
    """A satellite asks to train with the core; `signature` is its rank 0's parameter names and
    shapes, `ranks` and `tp` its layout (the core's must be the same: rank r pulls from rank r)."""

    cell: str
    signature: list
    ranks: int = 1
    tp: int = 1


@message
class Welcome:
    """The core accepts: where each of its ranks keeps its weight shard and gradient slots
    ([(Mooncake session, weights address, slots address)] by rank), and the weights' version."""

    peers: list
    version: int


@message
class Refused:
    reason: str


@message
class Claim:
    cell: str


@message
class Work:
    """Micro-step `index` of the step at weight `version`, for data-parallel replica `replica`:
    each of its ranks writes its gradient shard to row `slot` of its core peer's slots.

    The gradient is computed with normaliser 1: the core divides the folded sum by the step's
    total loss weight, which is known only once the step's batches have all arrived.
    """

    index: int
    version: int
    slot: int
    batch: PackedBatch
    replica: int = 0


@message
class Wait:
    """Nothing to claim now (no step open, all claimed, or no free slot): ask again soon."""


@message
class Evicted:
    """The core presumed this cell hung and redid its work; it gets no more work on this channel."""


@message
class Done:
    """Micro-step `index` is written into its slot; `seconds` = forward, backward and the write;
    `rank` computed it (with its tensor-parallel peers), on data-parallel replica `replica`."""

    index: int
    stats: dict
    seconds: float
    rank: int = 0
    replica: int = 0


@message
class Pull:
    """The cell wants to read the core's weights; the core answers WeightVersion once it is safe."""

    cell: str


@message
class PullDone:
    """The pull is over: the core may change its weights again."""

    cell: str


@message
class Leave:
    cell: CellId


# ---- coordinator <-> cell leaders -----------------------------------------------------------
@message
class CellReady:
    """A cell leader built its trainer and engines (`engine_urls`, gyre.cells.serving's order). The
    core adds where satellites join it, its weights as published, its step and a digest of its weights."""

    cell: int
    engine_urls: list
    core_address: str = ""
    weights: PublishedWeights | None = None
    step: int = 0
    weights_digest: str = ""


@message
class RoleSwitch:
    """Switch scheduler cell `cell` to role `target` ("train" or "rollout"). `weights`: the newest
    published weights an engine returning to rollout loads; `core_address`: where a satellite
    joining training finds the core."""

    cell: int
    target: str
    weights: PublishedWeights | None = None
    core_address: str = ""


@message
class PhaseDone:
    """A phase of a role switch finished: `rank_seconds[r]` until rank r had done its part, `seconds`
    the cell's (its slowest rank's; see gyre/cells/serving.py and gyre/scheduler/cells.py)."""

    cell: int
    phase: str
    seconds: float
    rank_seconds: list = field(default_factory=list)


@message
class RoleDone:
    """The switch is over: the cell holds `role`; `phases` maps each phase to the cell's seconds, in
    order, and `rank_phases` each phase to its seconds by rank."""

    cell: int
    role: str
    t_start: float
    phases: dict
    rank_phases: dict = field(default_factory=dict)


@message
class MicroBatches:
    """Group `group`'s micro-batches of step `step` for the core (streamed as groups become ready):
    `batches[k]` is micro-batch (step, group, k)."""

    step: int
    group: int
    batches: list


@message
class EndStep:
    """Step `step` has all its micro-batches: apply its optimizer step once they are trained."""

    step: int


@message
class StepProgress:
    """MicroBatchIds of the step's micro-batches trained (or screened out: nothing to train) so far."""

    step: int
    done: list


@message
class StepDone:
    """The core applied step `step`: weights are now `version`, published as `weights`."""

    step: int
    version: int
    metrics: dict
    weights: PublishedWeights
    seconds: float


@message
class SaveCheckpoint:
    """Checkpoint the core at `step`; `extra` is the coordinator's state saved with it."""

    step: int
    extra: dict


@message
class CheckpointDone:
    step: int
    path: str
    seconds: float
    weights_digest: str = ""


@message
class Stop:
    """Leave: stop the engine and exit."""


@message
class Heartbeat:
    """I am alive at `t` (sender's clock, seconds); silence past a timeout means dead."""

    cell: CellId
    t: float


@message
class WeightVersion:
    version: int


@message
class Failure:
    """Something broke on `cell`; `reason` says what."""

    cell: CellId
    reason: str
