"""The rollout side of the run: groups admitted within the staleness bound, one sandbox per execution.

    admit_groups (may_admit) ─> queued ─start_queued (free slots)─> running ─poll─> evaluate ─> group ready

Group g belongs to step g // groups_per_step and draws its task from the task set at cursor g, so
a resumed run continues the same sequence. Every state change is a ledger line first.
"""

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from gyre.coordinator.ledger import ExecutionLedger, LedgerEntry, LedgerView
from gyre.errors import GyreError
from gyre.harness.config import HarnessConfig
from gyre.harness.sandbox import Sandbox
from gyre.proxy.admin import ProxyAdmin
from gyre.scheduler.streaming import may_admit
from gyre.tasks.evaluate import evaluate
from gyre.tasks.spec import Task, TaskSet
from gyre.trajectory.rewards import Evaluation

log = logging.getLogger(__name__)


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


class GroupBook:
    """Groups and their executions, every state change written to the ledger (and to `on_state`)."""

    def __init__(self, groups_per_step: int, ledger: ExecutionLedger, on_state=None):
        self.groups_per_step, self.ledger, self.on_state = groups_per_step, ledger, on_state
        self.groups: dict[int, Group] = {}
        self.next_group = 0
        """The data cursor: groups drawn so far."""

    def _log(self, ex: Execution, state: str, **fields) -> None:
        ex.state = state
        entry = LedgerEntry(
            ex.execution_id,
            state,
            time.time(),
            group=ex.group,
            task_id=ex.task.task_id,
            **{k: v for k, v in fields.items() if v not in (None, "")},
        )
        self.ledger.append(entry)
        if self.on_state is not None:
            self.on_state(entry, ex.group // self.groups_per_step)

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


class Rollouts(GroupBook):
    """Executions from admission to evaluation."""

    def __init__(
        self,
        *,
        taskset: TaskSet,
        harness: HarnessConfig,
        group_size: int,
        groups_per_step: int,
        num_steps: int,
        staleness: int,
        seed: int,
        model: str,
        run_dir: Path,
        ledger: ExecutionLedger,
        proxy: ProxyAdmin,
        proxy_url: str,
        records_dir: Path,
        on_state=None,
    ):
        super().__init__(groups_per_step, ledger, on_state)
        self.taskset, self.harness, self.group_size = taskset, harness, group_size
        self.num_steps, self.staleness, self.seed, self.model = num_steps, staleness, seed, model
        self.sandbox_root, self.proxy, self.proxy_url = run_dir / "sandboxes", proxy, proxy_url
        self.records_dir = records_dir
        self.queue: list[Execution] = []
        self.running: list[Execution] = []

    # ---- admission ---------------------------------------------------------------------------
    def admit_groups(self, version: int) -> None:
        """Draw the groups the staleness bound lets start under weight version `version`."""
        while (step := self.next_group // self.groups_per_step) < self.num_steps and may_admit(
            step, version, self.staleness
        ):
            g = Group(self.next_group, step, self.taskset.pick(self.seed, self.next_group))
            for i in range(self.group_size):
                g.executions.append(Execution(f"g{g.index:05d}-{i}", g.index, g.task))
            self.groups[g.index] = g
            self.next_group += 1
            for ex in g.executions:
                self._log(ex, "queued")
                self.queue.append(ex)

    def restore(self, view: LedgerView, version: int) -> None:
        """Rebuild the groups not yet trained under the restored weights (`version`) from the ledger.

        Rule for executions in flight at the checkpoint: an execution with an outcome keeps it (its
        records and score are durable); one without is marked excluded (interrupted) and re-run
        as a new attempt, so none is lost and none is trained twice.
        """
        by_group: dict[int, list[LedgerEntry]] = {}
        for entries in view.history.values():
            by_group.setdefault(entries[0].group, []).append(entries[0])
        self.next_group = max(by_group, default=-1) + 1
        for gi in sorted(by_group):
            step = gi // self.groups_per_step
            if step < version:
                continue
            g = self.groups[gi] = Group(gi, step, self.taskset.get(by_group[gi][0].task_id))
            for first in sorted(by_group[gi], key=lambda e: e.execution_id):
                if not first.execution_id.split("-")[-1].isdigit():
                    continue  # an attempt: found through its original below
                g.executions.append(self._restore_execution(view, first.execution_id, g))

    def _restore_execution(self, view: LedgerView, execution_id: str, g: Group) -> Execution:
        attempt, eid = 0, execution_id
        while f"{execution_id}.r{attempt + 1}" in view.history:
            attempt += 1
            eid = f"{execution_id}.r{attempt}"
        ex = Execution(eid, g.index, g.task)
        done = view.outcome(eid)
        if done is not None:
            outcome = {"finished": "finished", "timed_out": "timed_out"}.get(done.state)
            ex.state, ex.records_path = done.state, self.records_dir / f"{eid}.jsonl"
            ex.evaluation = (
                Evaluation(outcome, done.score) if outcome else Evaluation("evaluator_error", None, done.reason)
            )
            return ex
        self._log(ex, "excluded", reason="interrupted")
        retry = Execution(f"{execution_id}.r{attempt + 1}", g.index, g.task)
        self._log(retry, "queued")
        self.queue.append(retry)
        return retry

    # ---- running ------------------------------------------------------------------------------
    async def start_queued(self, free_slots: int) -> None:
        """Start queued executions, oldest first, into `free_slots` session slots."""
        while self.queue and free_slots > 0:
            ex = self.queue.pop(0)
            free_slots -= 1
            try:
                reg = await self.proxy.create_execution(ex.execution_id)
                ex.records_path = Path(reg["records_path"])
                ex.sandbox = Sandbox(
                    ex.task,
                    ex.execution_id,
                    self.sandbox_root,
                    self.harness,
                    self.proxy_url,
                    reg["api_key"],
                    self.model,
                )
                await asyncio.to_thread(ex.sandbox.prepare)
                ex.sandbox.start()
            except (GyreError, OSError) as e:  # a sandbox, workspace or harness that cannot start
                log.warning("execution %s could not start: %s", ex.execution_id, e)
                ex.evaluation = Evaluation("evaluator_error", None, f"sandbox: {e}")
                self._log(ex, "excluded", reason="sandbox_error")
                continue
            ex.started_s = time.monotonic()
            self.running.append(ex)
            self._log(ex, "running")

    async def collect(self) -> list[Execution]:
        """Evaluate the executions whose harness ended; returns them (their groups may be ready now)."""
        done = [(ex, r) for ex in self.running if (r := ex.sandbox.poll()) is not None]
        for ex, _ in done:
            self.running.remove(ex)
        await asyncio.gather(*(self._evaluate(ex, r) for ex, r in done))
        return [ex for ex, _ in done]

    async def _evaluate(self, ex: Execution, result) -> None:
        """Score the workspace, unless the policy never acted: a harness that made no model call
        (exited at once, crashed on start, or did the work itself) is excluded, never scored."""
        outcome = "timed_out" if result.timed_out else "finished"
        ex.duration_s = result.duration_s
        try:
            await self.proxy.revoke_execution(ex.execution_id)
        except Exception as e:  # a revoke that fails leaves a key valid, nothing else
            log.warning("revoking %s: %s", ex.execution_id, e)
        if not _made_calls(ex.records_path):
            reason = "harness_failed" if result.exit_code != 0 else "no_model_calls"
            ex.evaluation = Evaluation(outcome, None, reason)
            self._log(ex, "excluded", reason=reason, duration_s=ex.duration_s, exit_code=result.exit_code)
            return
        ex.evaluation = ev = await asyncio.to_thread(evaluate, ex.task, result.workspace, outcome)
        if ev.outcome in ("finished", "timed_out") and ev.score is not None:
            self._log(ex, ev.outcome, score=ev.score, duration_s=ex.duration_s, exit_code=result.exit_code)
        else:
            reason = "no_score" if ev.outcome in ("finished", "timed_out") else ev.outcome
            self._log(ex, "excluded", reason=reason, duration_s=ex.duration_s, exit_code=result.exit_code)

    def counts(self, version: int) -> tuple[int, int, int]:
        """(queued, queued for later steps than `version`, running)."""
        ahead = sum(1 for ex in self.queue if self.groups[ex.group].step > version)
        return len(self.queue), ahead, len(self.running)

    def close(self) -> None:
        for ex in self.running:
            ex.sandbox.kill()


def _made_calls(records_path: Path | None) -> bool:
    """Whether the proxy recorded at least one model call of the execution."""
    return records_path is not None and records_path.is_file() and records_path.stat().st_size > 0
