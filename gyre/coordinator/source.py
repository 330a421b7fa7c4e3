"""Where a run's groups come from, behind one interface: live rollouts (mode=train and rollout,
gyre.coordinator.rollouts) or an earlier run's records (mode=replay, gyre.coordinator.replay).

The loop asks a Source what it needs each tick and never reads the mode: what differs between modes
(how many steps, whether groups start, whether they train) is the source's.
"""

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gyre.common.run_paths import record_path
from gyre.coordinator.ledger import ExecutionLedger, LedgerEntry, LedgerView
from gyre.harness.sandbox import Sandbox
from gyre.proxy.admin import ProxyAdmin
from gyre.tasks.spec import Task
from gyre.trajectory.rewards import HARNESS_OUTCOMES, OUTCOMES, Evaluation

if TYPE_CHECKING:  # training.py imports Group from here
    from gyre.coordinator.training import Training


@dataclass
class Execution:
    execution_id: str
    group: int
    task: Task
    state: str = "queued"
    sandbox: Sandbox | None = None
    records_path: Path | None = None
    evaluation: Evaluation | None = None
    started_s: float = 0.0
    duration_s: float = 0.0
    held_out: int | None = None
    """A held-out execution (never trained, not in the ledger): the weight version it evaluates."""
    used_s: float | None = None
    """A continued execution (a restart interrupted it): the time budget it used before the break."""


@dataclass
class Group:
    index: int
    step: int
    task: Task
    executions: list[Execution] = field(default_factory=list)
    batched: bool = False

    @property
    def ready(self) -> bool:
        return all(e.evaluation is not None for e in self.executions)


class Source(Protocol):
    """What the coordinator's loop asks of the side that supplies groups."""

    num_steps: int
    """RL steps this source feeds (the run ends after them)."""
    next_group: int
    """The data cursor: groups drawn so far (a checkpoint keeps it)."""

    def attach(self, proxy: ProxyAdmin, proxy_url: str) -> None:
        """The run's proxy, once it is up."""

    def restore(self, view: LedgerView, version: int) -> None:
        """Resume: rebuild the groups not trained under weight version `version` from the ledger."""

    def counts(self, version: int) -> tuple[int, int, int, int]:
        """(queued, of those for later steps than `version`, running, of those for later steps)."""

    async def advance(self, version: int, free_slots: int) -> None:
        """Admit, start into `free_slots` session slots and evaluate what the staleness bound allows."""

    def feed(self, train: "Training") -> None:
        """Hand the groups that became ready to training."""

    def mark_trained(self, group: Group, execution_ids: set[str], step: int) -> None:
        """Record that checkpointed optimizer step `step` trained these executions."""

    def done(self, train: "Training") -> bool:
        """Whether the run has nothing left to do."""

    def close(self) -> None:
        """Stop whatever still runs."""


class GroupBook:
    """Groups and their executions, every state change written to the ledger and told to `events`
    (gyre.coordinator.summary.RunEvents: execution states; held-out executions' results)."""

    def __init__(self, groups_per_step: int, num_steps: int, ledger: ExecutionLedger, events=None):
        self.groups_per_step, self.num_steps, self.ledger, self.events = groups_per_step, num_steps, ledger, events
        self.groups: dict[int, Group] = {}
        self.next_group = 0
        """The data cursor: groups drawn so far."""

    def _log(self, ex: Execution, state: str, **fields) -> None:
        ex.state = state
        if ex.held_out is not None:
            if state not in ("queued", "running") and self.events is not None:
                self.events.held_out(ex)
            return
        entry = LedgerEntry(
            ex.execution_id,
            state,
            time.time(),
            group=ex.group,
            task_id=ex.task.task_id,
            **{k: v for k, v in fields.items() if v not in (None, "")},
        )
        self.ledger.append(entry)
        if self.events is not None:
            self.events.execution_state(entry, ex.group // self.groups_per_step)

    def log_exclusions(self, group: Group, excluded: list[tuple[str, str]]) -> None:
        """Ledger lines for executions the trajectory processor left out (not those excluded already)."""
        by_id = {ex.execution_id: ex for ex in group.executions}
        for eid, reason in excluded:
            ex = by_id.get(eid)
            if ex is not None and ex.state != "excluded":
                self._log(ex, "excluded", reason=reason)

    def mark_trained(self, group: Group, execution_ids: set[str], step: int) -> None:
        """Ledger lines for the executions whose targets optimizer step `step` trained (checkpointed)."""
        for ex in group.executions:
            if ex.execution_id in execution_ids:
                self._log(ex, "trained", step=step)

    def ready_groups(self) -> list[Group]:
        """Groups whose executions all have an evaluation and that were not batched yet, in order."""
        return [g for g in sorted(self.groups.values(), key=lambda g: g.index) if not g.batched and g.ready]

    def feed(self, train: "Training") -> None:
        for group in self.ready_groups():
            self.log_exclusions(group, train.add_group(group).excluded)

    def done(self, train: "Training") -> bool:
        """Every step trained and checkpointed."""
        return train.version >= self.num_steps and not train.uncheckpointed


def recorded(done: LedgerEntry, group: Group, records_dir: Path) -> Execution:
    """The execution whose outcome `done` the ledger holds: its records and its score are durable."""
    if done.state in HARNESS_OUTCOMES:
        ev = Evaluation(done.state, done.score)
    else:  # excluded: its reason, where it is an outcome (budget_exhausted), counts as it did live
        ev = Evaluation(done.reason if done.reason in OUTCOMES else "evaluator_error", None, done.reason)
    eid = done.execution_id
    return Execution(
        eid, group.index, group.task, done.state, records_path=record_path(records_dir, eid), evaluation=ev
    )
