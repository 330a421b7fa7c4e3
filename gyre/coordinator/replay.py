"""Replay: train from an earlier run's records and evaluations, with no rollouts (mode=replay).

The earlier run's ledger says which executions each group had and how each was scored; its
records directory holds their calls. Groups keep their numbering, so step k trains what step k
of the earlier run would have, and a step's groups are batched in the order the earlier run
batched them (the order of their `trained` entries), so its micro-steps are summed in the same
order and the replay's weights equal the run's bit for bit. Useful to debug training alone, or to
train on collected data.
"""

from pathlib import Path

from gyre.common.run_paths import RunPaths
from gyre.coordinator.config import GyreConfig
from gyre.coordinator.ledger import ExecutionLedger, LedgerView, read_ledger
from gyre.coordinator.source import Group, GroupBook, recorded
from gyre.errors import GyreError
from gyre.proxy.admin import ProxyAdmin
from gyre.tasks.taskset import TaskSource


class ReplayError(GyreError):
    """The records directory has no ledger beside it, or the ledger no finished group."""


class ReplaySource(GroupBook):
    """Every recorded group is ready at once, nothing runs; it feeds at most the recorded complete steps."""

    def __init__(self, cfg: GyreConfig, run_dir: Path, taskset: TaskSource, ledger: ExecutionLedger, events=None):
        records_dir, groups_per_step = Path(cfg.records), cfg.coordinator.groups_per_step
        ledger_path = RunPaths(records_dir.parent).ledger
        if not ledger_path.exists():
            raise ReplayError(f"replay needs the run's ledger beside its records: {ledger_path} does not exist")
        view = read_ledger(ledger_path)
        super().__init__(groups_per_step, cfg.num_steps, ledger, events)
        self._batched_at: dict[int, float] = {}
        """group -> when the earlier run recorded it trained (its steps' groups were batched in
        that order); groups never trained go last, by number."""
        for eid, entries in sorted(view.history.items()):
            for e in entries:
                if e.state == "trained":
                    self._batched_at[e.group] = min(e.t, self._batched_at.get(e.group, e.t))
            done = view.outcome(eid)
            if done is None or done.reason == "interrupted":
                continue
            first = entries[0]
            g = self.groups.setdefault(
                first.group, Group(first.group, first.group // groups_per_step, taskset.get(first.task_id))
            )
            ex = recorded(done, g, records_dir)
            g.executions.append(ex)
            self._log(ex, done.state, score=done.score, reason=done.reason)
        complete = 0  # steps whose every group is recorded (a cut-off run's last step is not replayed)
        while all(complete * groups_per_step + i in self.groups for i in range(groups_per_step)):
            complete += 1
        if not complete:
            raise ReplayError(
                f"{ledger_path} has no complete step of {groups_per_step} groups with outcomes to train on"
            )
        self.groups = {i: g for i, g in self.groups.items() if g.step < complete}
        self.next_group = max(self.groups) + 1
        self.num_steps = min(cfg.num_steps, complete)

    def ready_groups(self) -> list[Group]:
        """The ready groups in the earlier run's batching order."""
        inf = float("inf")
        return sorted(super().ready_groups(), key=lambda g: (g.step, self._batched_at.get(g.index, inf), g.index))

    def attach(self, proxy: ProxyAdmin, proxy_url: str) -> None:
        pass

    def restore(self, view: LedgerView, version: int) -> None:
        """Drop the steps the restored weights have trained; the rest are replayed again."""
        self.groups = {i: g for i, g in self.groups.items() if g.step >= version}

    async def advance(self, version: int, free_slots: int) -> None:
        pass

    def counts(self, version: int) -> tuple[int, int, int, int]:
        return 0, 0, 0, 0

    def close(self) -> None:
        pass
