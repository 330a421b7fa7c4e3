"""Replay: train from an earlier run's records and evaluations, with no rollouts (mode=replay).

The earlier run's ledger says which executions each group had and how each was scored; its
records directory holds their calls. Groups keep their numbering, so step k trains what step k
of the earlier run would have. Useful to debug training alone, or to train on collected data.
"""

from pathlib import Path

from gyre.coordinator.ledger import ExecutionLedger, read_ledger
from gyre.coordinator.rollouts import Execution, Group, GroupBook
from gyre.errors import GyreError
from gyre.tasks.spec import TaskSet
from gyre.trajectory.rewards import Evaluation


class ReplayError(GyreError):
    """The records directory has no ledger beside it, or the ledger no finished group."""


class ReplaySource(GroupBook):
    """Stands in for Rollouts: every recorded group is ready at once, nothing runs."""

    def __init__(
        self, records_dir: Path, taskset: TaskSet, groups_per_step: int, ledger: ExecutionLedger, on_state=None
    ):
        ledger_path = records_dir.parent / "ledger.jsonl"
        if not ledger_path.exists():
            raise ReplayError(f"replay needs the run's ledger beside its records: {ledger_path} does not exist")
        view = read_ledger(ledger_path)
        super().__init__(groups_per_step, ledger, on_state)
        for eid, entries in sorted(view.history.items()):
            done = view.outcome(eid)
            if done is None or done.reason == "interrupted":
                continue
            first = entries[0]
            g = self.groups.setdefault(
                first.group, Group(first.group, first.group // groups_per_step, taskset.get(first.task_id))
            )
            ex = Execution(eid, g.index, g.task, state=done.state, records_path=records_dir / f"{eid}.jsonl")
            ex.evaluation = (
                Evaluation(done.state, done.score)
                if done.state in ("finished", "timed_out")
                else Evaluation("evaluator_error", None, done.reason)
            )
            g.executions.append(ex)
            self._log(ex, done.state, score=done.score, reason=done.reason)
        self.num_steps = 0
        """Steps whose every group is recorded (a cut-off run's last step is not replayed)."""
        while all(self.num_steps * groups_per_step + i in self.groups for i in range(groups_per_step)):
            self.num_steps += 1
        if not self.num_steps:
            raise ReplayError(
                f"{ledger_path} has no complete step of {groups_per_step} groups with outcomes to train on"
            )
        self.groups = {i: g for i, g in self.groups.items() if g.step < self.num_steps}
        self.next_group = max(self.groups) + 1

    def admit_groups(self, version: int) -> None:
        pass

    async def start_queued(self, free_slots: int) -> None:
        pass

    async def collect(self) -> list:
        return []

    def counts(self, version: int) -> tuple[int, int, int]:
        return 0, 0, 0

    def close(self) -> None:
        pass
