"""The core's state for one optimizer step: the one step ledger, a record per micro-batch.

    add_micro_batch ─> MicroBatch(ready) ─claim─> held by a cell (a replica's slot) ─complete─> done
         └─ handed back (the cell left, died or timed out): ready again, first in line, counted redone
    done, in index order ─> folded into the sum (its slot freed) ─> every one folded ─> one optimizer step

`CoreState` owns the step, the gradient slots and who reads the weights, under one condition
variable; the step's driver (gyre.train.elastic.CoreServer) and the satellites' door
(gyre.train.core_door.SatelliteDoor) change them only through its methods. Slots are per
data-parallel replica: (replica, row) is row `row` of the slot buffer of that replica's core ranks
(gyre/train/shard.py), so micro-steps in flight grow with the replicas that compute while each
core rank holds `num_grad_slots` rows of its shard, whatever the cell's size. Callers of the methods
marked "lock held" hold `cond`; every other method takes it.
"""

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from gyre.control import messages as m
from gyre.trajectory.sample import PackedBatch

CORE = "core"
"""The cell name the core computes under."""


@dataclass
class MicroBatch:
    """One micro-batch of the open step, from its arrival to its fold."""

    index: int
    """Its place in the step: gradients are added in index order, whoever computed them."""
    id: m.MicroBatchId
    """The id the coordinator gave it (reported back once trained)."""
    batch: PackedBatch
    holder: str | None = None
    """The cell computing it now (None: ready, or done)."""
    claimed_s: float = 0.0
    slot: int | None = None
    """The row of its replica's gradient slots its result goes to, until folded (None: not held,
    or computed by the core straight into the sum)."""
    done_by: str | None = None
    """The cell whose result was accepted."""
    replica: int = 0
    """The data-parallel replica whose ranks compute it and hold its gradient (its slot's)."""
    stats: dict = field(default_factory=dict)
    timing: tuple[float, float, int] = (0.0, 0.0, 0)
    """(seconds computing, unix time it ended, rank of the cell that computed it)."""


@dataclass
class OpenStep:
    """The step the core is building: its micro-batches and what was screened out of it."""

    version: int
    batches: list[MicroBatch] = field(default_factory=list)
    ready: deque = field(default_factory=deque)
    """Indices not yet claimed, in the order they are handed out."""
    screened: list[m.MicroBatchId] = field(default_factory=list)
    """Ids with nothing trainable in them: done as they arrive."""
    excluded: Counter = field(default_factory=Counter)
    screened_weight: float = 0.0
    total_weight: float | None = None
    """The loss normaliser once the step is ended (no more micro-batches)."""
    folded: int = 0
    redone: int = 0
    """Claims given back by cells that left, died or timed out before finishing."""
    in_flight: int = 0
    """Claims held now."""
    peak_in_flight: int = 0
    """The most claims held at once this step."""
    running: bool = False
    aborted: bool = False

    def claim(self, cell: str, now: float, index: int | None = None) -> MicroBatch | None:
        """The next ready micro-batch (with `index`: that one only), now held by `cell`."""
        if index is None:
            if not self.ready:
                return None
            index = self.ready.popleft()
        elif index in self.ready:
            self.ready.remove(index)
        else:
            return None
        mb = self.batches[index]
        mb.holder, mb.claimed_s = cell, now
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return mb

    def complete(self, mb: MicroBatch, cell: str) -> bool:
        """`cell`'s result for `mb` counts only if `cell` still holds it (else it was redone elsewhere)."""
        if mb.holder != cell:
            return False
        mb.holder, mb.done_by = None, cell
        self.in_flight -= 1
        return True

    def release(self, cell: str) -> list[MicroBatch]:
        """Every claim `cell` holds goes back to the front of the line, in index order."""
        lost = [mb for mb in self.batches if mb.holder == cell]
        for mb in reversed(lost):
            mb.holder = None
            self.ready.appendleft(mb.index)
        self.redone += len(lost)
        self.in_flight -= len(lost)
        return lost

    def overdue(self, now: float, timeout_s: float) -> set[str]:
        """Cells holding a claim for longer than `timeout_s`."""
        return {mb.holder for mb in self.batches if mb.holder is not None and now - mb.claimed_s > timeout_s}

    def foldable(self) -> list[MicroBatch]:
        """The next done micro-batches in index order whose gradients wait in a slot."""
        out = []
        while self.folded < len(self.batches):
            mb = self.batches[self.folded]
            if mb.done_by is None or mb.slot is None:
                break
            out.append(mb)
            self.folded += 1
        return out

    @property
    def complete_whole(self) -> bool:
        """Ended and folded whole: the optimizer step may run."""
        return self.total_weight is not None and self.folded == len(self.batches)


class CoreState:
    """The open step, the gradient slots and the weights' readers, under one condition variable.

    Args:
        num_slots: gradient slots per data-parallel replica (`num_grad_slots`): one per claim in flight.
        version: the weight version the core holds now.
        num_replicas: the cell layout's data-parallel replicas (the core's, and every satellite's).
    """

    def __init__(self, num_slots: int, version: int, num_replicas: int = 1):
        self.cond = threading.Condition()
        self.version = version
        self.num_replicas = num_replicas
        self.step: OpenStep | None = None
        self.free: deque[tuple[int, int]] = deque((d, row) for row in range(num_slots) for d in range(num_replicas))
        """Free (replica, row) slots; a freed one goes to the back (a late write of a dead cell
        never lands in a slot reused at once)."""
        self.quarantine: dict[str, list[tuple[int, int]]] = {}
        """Slots a cell presumed hung may still write: freed once its channel closes."""
        self.readers: Counter = Counter()
        """Who is copying the weights now (cells pulling, "publish"): no optimizer step meanwhile."""
        self.pull_started: dict[str, float] = {}
        self.applying = False
        self.cells: dict[str, object] = {}
        """Joined satellites: name -> their channel."""
        self.evicted: set[str] = set()

    # ---- the satellites' side (gyre.train.core_door) ------------------------------------------
    def join(self, cell: str, channel: object) -> int | None:
        """Admit `cell`; returns the version it joins at (None: the name is taken)."""
        with self.cond:
            if cell in self.cells or cell == CORE:
                return None
            self.cells[cell] = channel
            return self.version

    def grant(self, cell: str) -> object:
        """What a satellite's Claim gets: Work with a slot on one of its replicas that holds no
        claim yet (each replica computes one micro-step at a time), Wait, or Evicted."""
        with self.cond:
            if cell in self.evicted:
                return m.Evicted()
            held = {mb.replica for mb in self.step.batches if mb.holder == cell} if self.step is not None else set()
            if (mb := self.claim_slot(cell, set(range(self.num_replicas)) - held)) is None:
                return m.Wait()
            return m.Work(mb.index, self.step.version, mb.slot, mb.batch, mb.replica)

    def accept(self, cell: str, msg: m.Done) -> None:
        """A satellite's result: booked if it still holds the claim (else it was redone elsewhere)."""
        with self.cond:
            step = self.step
            if step is not None and 0 <= msg.index < len(step.batches):
                mb = step.batches[msg.index]
                if step.complete(mb, cell):
                    mb.stats = msg.stats  # its replica is the one granted: its slot lives there
                    mb.timing = (msg.seconds, time.time(), msg.rank)  # its result just arrived
            self.cond.notify_all()

    def start_pull(self, cell: str) -> int:
        """`cell` copies the weights: no optimizer step until it says PullDone; returns their version."""
        with self.cond:
            while self.applying:
                self.cond.wait()
            self.readers[cell] += 1
            self.pull_started[cell] = time.monotonic()
            return self.version

    def end_pull(self, cell: str, all_of_them: bool = False) -> None:
        with self.cond:
            if self.readers[cell] > 0:
                self.readers[cell] = 0 if all_of_them else self.readers[cell] - 1
            self.readers += Counter()  # drop zero counts
            self.cond.notify_all()

    def release(self, cell: str) -> None:
        """`cell` left: its claims go back to the queue, its slots are free, its pulls end."""
        with self.cond:
            for mb in self.step.release(cell) if self.step is not None else []:
                self.free.append((mb.replica, mb.slot))
                mb.slot = None
            self.end_pull(cell, all_of_them=True)
            self.cond.notify_all()

    def gone(self, cell: str, channel: object) -> None:
        """`cell`'s channel closed (the process is gone): what it held and what it may have written is free."""
        with self.cond:
            if self.cells.get(cell) is channel:
                del self.cells[cell]
            self.evicted.discard(cell)
            self.free.extend(self.quarantine.pop(cell, []))
            self.cond.notify_all()
        self.release(cell)

    # ---- both sides ---------------------------------------------------------------------------
    def claim_slot(self, cell: str, replicas: set[int]) -> MicroBatch | None:
        """(lock held) The next ready micro-batch, now held by `cell` with the first free slot on
        one of `replicas` (None: nothing ready, or no such slot free)."""
        step = self.step
        if step is None or not step.ready:
            return None
        for i, (replica, row) in enumerate(self.free):
            if replica in replicas:
                del self.free[i]
                mb = step.claim(cell, time.monotonic())
                mb.replica, mb.slot = replica, row
                return mb
        return None

    # ---- the step's driver (gyre.train.elastic) -------------------------------------------------
    def evict_overdue(self, timeout_s: float) -> dict[str, list[int]]:
        """(lock held) Take micro-batches back from cells holding one past `timeout_s` (hung, not
        dead); their slots stay quarantined until their channel closes. Returns {cell: indices}."""
        step, out = self.step, {}
        if not timeout_s or step is None:
            return out
        for cell in step.overdue(time.monotonic(), timeout_s) - {CORE}:
            self.evicted.add(cell)
            lost = step.release(cell)
            self.quarantine.setdefault(cell, []).extend((mb.replica, mb.slot) for mb in lost)
            for mb in lost:
                mb.slot = None
            out[cell] = [mb.index for mb in lost]
        return out

    def evict_hung_pulls(self, timeout_s: float) -> list[str]:
        """(lock held) Cells whose announced pull lasts past `timeout_s`: the step goes on without
        waiting for them, and they get no more work on their channel. Returns them."""
        now, out = time.monotonic(), []
        for cell in [c for c in self.readers if c != "publish"] if timeout_s else []:
            if now - self.pull_started.get(cell, now) > timeout_s:
                del self.readers[cell]
                self.evicted.add(cell)
                out.append(cell)
        return out

    def finish(self, step: OpenStep, applied: bool, version: int) -> None:
        """The step is over (applied: the core is at `version` now); without the optimizer step
        (an error, an abort) its in-flight claims keep their slots quarantined: late results are
        refused, as no claim matches any more."""
        with self.cond:
            self.applying, self.step = False, None
            if applied:
                self.version = version
            else:
                for mb in step.batches:
                    if mb.slot is not None:
                        held = mb.holder if mb.holder not in (None, CORE) else None
                        (self.quarantine.setdefault(held, []) if held else self.free).append((mb.replica, mb.slot))
            self.cond.notify_all()

    def progress(self) -> tuple[dict[int, str], dict[int, str]]:
        """(micro-batch -> cell computing it, micro-batch -> cell that did it) of the open step."""
        with self.cond:
            batches = self.step.batches if self.step is not None else []
            return (
                {mb.index: mb.holder for mb in batches if mb.holder is not None},
                {mb.index: mb.done_by for mb in batches if mb.done_by is not None},
            )
