"""Staleness rule and streaming training: ready groups become micro-steps that training cells claim.

Staleness rule (identical in every mode). Groups are launched in the order of the workload; group
number i belongs to nominal step i // G and may launch once the weight version v satisfies
i // G <= v + s (`may_admit`): at most s + 1 steps' worth of groups are ever ahead of training.
An execution runs to completion or to its time budget across any number of weight updates; its
later model calls are served by newer weights and the records carry the version of every output
span ("continue with per-span versions"). Which step trains a group is set by `batching`:

  fixed        a group is trained at its nominal step; the step waits for its slowest execution
               (at most the time budget). Every span is within the bound by construction.
  first_ready  a step trains the first G groups that become ready (`open_step`), whatever their
               nominal step; groups finishing later fill later steps. The step no longer waits for
               its stragglers. A group trained at step k keeps the loss only on spans generated
               under versions >= k - s; older spans stay in the sequence as context (their compute
               is still paid) but are masked out of the loss and counted. An execution with no span
               left inside the bound is dropped and counted, never trained as zero.

Either way no trained token is older than the bound; `claim` checks the oldest trained span again
and raises rather than train over it. An execution that ends without a valid reward (time budget
exhausted with nothing evaluable, evaluator crash) is excluded and counted, never trained as zero.

    executions finish ──> group ready (all finished or excluded) ──> MicroStepQueue[step]
    TRAIN cells ──claim()──> micro-step of the current step (faster cells claim more often)
    all groups of the step trained ──> core applies ONE optimizer step ──> version + 1

The live run keeps the same rule per group (gyre.coordinator.training) and per micro-batch on the
core (gyre.train.core_state); this queue is the simulator's.
"""

from collections import deque
from dataclasses import dataclass, field

from gyre.scheduler.cells import SchedulerError


class StalenessError(SchedulerError):
    """A sample would be trained more than `staleness` versions after its behaviour policy."""


def may_admit(step: int, version: int, staleness: int) -> bool:
    """Whether groups bound to `step` may start now, under weight version `version`."""
    return step <= version + staleness


def check_staleness(start_version: int, step: int, staleness: int) -> None:
    """Raise StalenessError unless a sample started under `start_version` may train at `step`."""
    if step > start_version + staleness:
        raise StalenessError(
            f"sample started under version {start_version} cannot train at step {step} (staleness bound {staleness})"
        )


def trained_spans(marks: list[tuple[int, int]], num_spans: int, step: int, staleness: int) -> tuple[int, int] | None:
    """The spans of an execution that may train at `step` under the per-span rule.

    Args:
        marks: (version, first span generated under it), in order.
        num_spans: spans the execution generated.

    Returns:
        (first trained span, its version): spans before it are masked as older than the bound;
        None when no span is inside the bound (the execution is dropped and counted).
    """
    floor = step - staleness
    for version, first in marks:
        if version >= floor:
            return (first, version) if first < num_spans else None
    return None


def split_tokens(tokens: int, max_tokens: int) -> list[int]:
    """`tokens` as near-equal parts of at most `max_tokens` each (0 = one part; none for 0 tokens)."""
    if tokens <= 0:
        return []
    n = -(-tokens // max_tokens) if max_tokens > 0 else 1
    return [tokens // n + (1 if i < tokens % n else 0) for i in range(n)]


@dataclass(frozen=True)
class MicroStep:
    """One ready group's training work for one step."""

    step: int
    group_id: int
    start_version: int
    tokens: int
    index: int = 0
    """Position among its step's micro-steps (the order gradients are added in)."""


@dataclass
class _StepState:
    ready: deque = field(default_factory=deque)
    accounted: int = 0  # groups ready or excluded
    in_flight: int = 0
    done: int = 0  # micro-steps completed
    num_micro: int = 0  # micro-steps created


class MicroStepQueue:
    """Micro-steps per step; only the current step (= current weight version) can be claimed.

    Args:
        groups_per_step: groups that make one RL step's batch.
        staleness: the bound s, checked again at every claim.
    """

    def __init__(self, groups_per_step: int, staleness: int):
        if groups_per_step < 1:
            raise SchedulerError(f"groups_per_step must be >= 1, got {groups_per_step}")
        self.groups_per_step = groups_per_step
        self.staleness = staleness
        self.version = 0
        self.max_lag = 0
        """Largest step - start_version ever claimed (never above `staleness`)."""
        self._steps: dict[int, _StepState] = {}

    @property
    def current_step(self) -> int:
        """The step being trained: step k turns version k into k + 1."""
        return self.version

    def _state(self, step: int) -> _StepState:
        if step < self.version:
            raise SchedulerError(f"step {step} is already applied (version {self.version})")
        return self._steps.setdefault(step, _StepState())

    def _account(self, st: _StepState, step: int) -> None:
        st.accounted += 1
        if st.accounted > self.groups_per_step:
            raise SchedulerError(f"step {step} got more than {self.groups_per_step} groups")

    def open_step(self) -> int:
        """The earliest step, from the current one on, whose batch still has room for a group
        (first_ready batching places each group that becomes ready there)."""
        step = self.version
        while (st := self._steps.get(step)) is not None and self._full(st):
            step += 1
        return step

    def _full(self, st: _StepState) -> bool:
        return st.accounted >= self.groups_per_step

    def add_ready(
        self, step: int, group_id: int, start_version: int, tokens: int, max_tokens: int = 0
    ) -> MicroStep | None:
        """A group of `step` is ready: all its executions finished or were excluded.

        `start_version` is the version of its oldest span that is trained (not masked).
        `max_tokens` > 0 splits the group into micro-steps of at most that many tokens (as even
        as whole tokens allow), so several cells can share one group's training.
        Returns the last new micro-step (None when `tokens` is 0: nothing to train).
        """
        st = self._state(step)
        self._account(st, step)
        ms = None
        for part in split_tokens(tokens, max_tokens):
            ms = MicroStep(step, group_id, start_version, part, index=st.num_micro)
            st.ready.append(ms)
            st.num_micro += 1
        return ms

    def exclude(self, step: int, group_id: int) -> None:
        """A group of `step` has no trainable execution; it counts as accounted for."""
        self._account(self._state(step), step)

    def claim(self) -> MicroStep | None:
        """The next ready micro-step of the current step; None: nothing is ready.

        Raises:
            StalenessError: it would exceed the bound (never happens if admission used may_admit).
        """
        st = self._steps.get(self.version)
        if st is None or not st.ready:
            return None
        ms = st.ready.popleft()
        check_staleness(ms.start_version, ms.step, self.staleness)
        self.max_lag = max(self.max_lag, ms.step - ms.start_version)
        st.in_flight += 1
        return ms

    def hand_back(self, ms: MicroStep) -> None:
        """A cell leaving training returns an unfinished micro-step; it is claimed first next."""
        st = self._steps[ms.step]
        st.in_flight -= 1
        st.ready.appendleft(ms)

    def complete(self, ms: MicroStep) -> None:
        """A micro-step's gradients are accumulated."""
        st = self._steps[ms.step]
        st.in_flight -= 1
        st.done += 1

    def batch_ready(self, step: int | None = None) -> bool:
        """Whether every group of `step` (default: current) is ready or excluded."""
        st = self._steps.get(self.version if step is None else step)
        return st is not None and st.accounted == self.groups_per_step

    def step_complete(self) -> bool:
        """Whether the current step's micro-steps are all trained, so the optimizer step may run."""
        return self.batch_ready() and self._steps[self.version].done == self._steps[self.version].num_micro

    def step_started(self) -> bool:
        """Whether any micro-step of the current step was claimed."""
        st = self._steps.get(self.version)
        return st is not None and (st.in_flight > 0 or st.done > 0)

    def ready_tokens(self) -> int:
        """Tokens of the current step that are ready and unclaimed."""
        st = self._steps.get(self.version)
        return sum(ms.tokens for ms in st.ready) if st else 0

    def ready_tokens_ahead(self) -> int:
        """Tokens already placed in steps after the current one (first_ready batching)."""
        return sum(ms.tokens for step, st in self._steps.items() if step > self.version for ms in st.ready)

    def apply_optimizer_step(self) -> int:
        """The core applied the current step's optimizer step; returns the new version.

        Raises:
            SchedulerError: the step still has untrained micro-steps or missing groups.
        """
        if not self.step_complete():
            raise SchedulerError(f"step {self.version} is not complete; the optimizer step must wait")
        del self._steps[self.version]
        self.version += 1
        return self.version
