"""The rollout side of the run: groups admitted within the staleness bound, one sandbox per execution.

    admit_groups (may_admit) ─> queued ─start_queued (slots, budget)─> running ─poll─> evaluate ─> group ready
    admit_held_out (first, every eval_every, last weights) ─> queue (groups wait) ─> ... ─> HeldOutResult event

Group g belongs to step g // groups_per_step and draws its task from the task set at cursor g, so
a resumed run continues the same sequence. Every state change is a ledger line first. Held-out
tasks (`tasks.held_out_path`) run the same way under weight version 0, every `tasks.eval_every`
steps' weights and the last weights, and are never trained nor in the ledger: their scores go to
the run's events only. A held-out execution is labelled with the version served when it started; in
the middle of a run, groups already admitted may train meanwhile (staleness), so its later calls may
be served the next version.
"""

import asyncio
import logging
import time
from pathlib import Path

from gyre.common.run_paths import RunPaths, record_path
from gyre.coordinator.config import GyreConfig
from gyre.coordinator.ledger import ExecutionLedger, LedgerEntry, LedgerView
from gyre.coordinator.source import Execution, Group, GroupBook, recorded
from gyre.errors import GyreError
from gyre.harness.evaluate import evaluate
from gyre.harness.sandbox import Sandbox, continuable
from gyre.harness.steps import finish_step
from gyre.proxy.admin import ProxyAdmin
from gyre.records.io import RecordFileError, has_records, read_records
from gyre.scheduler.streaming import may_admit
from gyre.tasks.taskset import TaskSet, TaskSource
from gyre.trajectory.rewards import HARNESS_OUTCOMES, OUTCOMES, Evaluation, unscored_reason

log = logging.getLogger(__name__)


class HarnessStartError(GyreError):
    """The harness never started: the first executions all ended without a model call."""


def check_harness_started(num_unstarted: int, num_first: int, kind: str, log_path: Path, reason: str) -> None:
    """Stop a run whose harness cannot start instead of training on nothing: once the first
    `num_first` executions to end (the first step's groups) all ended without a model call.

    Raises:
        HarnessStartError: naming the harness and the last line of the latest one's log.
    """
    if num_unstarted < num_first:
        return
    try:
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    last = lines[-1][-300:] if lines else "(empty)"
    raise HarnessStartError(
        f"harness.kind={kind}: the first {num_unstarted} executions all ended without a model call ({reason}); "
        f"the last one's harness log ({log_path}) ends: {last}"
    )


class Rollouts(GroupBook):
    """Executions from admission to evaluation (mode=train: every ready group trains)."""

    def __init__(self, cfg: GyreConfig, run_dir: Path, taskset: TaskSource, ledger: ExecutionLedger, events=None):
        c = cfg.coordinator
        super().__init__(c.groups_per_step, cfg.num_steps, ledger, events)
        path = cfg.tasks.held_out_path
        self.held_out_tasks = TaskSet.load(path, cfg.tasks).tasks if path else []
        self.held_out_samples = cfg.tasks.eval_samples
        self.held_out_at = cfg.tasks.eval_versions(cfg.num_steps)
        """Weight versions to evaluate the held-out tasks under."""
        self.held_out_versions: set[int] = set()
        """Weight versions whose held-out rollouts were admitted."""
        self.taskset, self.harness, self.group_size = taskset, cfg.harness, c.group_size
        self.staleness, self.seed, self.model = cfg.scheduler.staleness, cfg.seed, cfg.proxy.model_names[0]
        self.sandbox_root, self.records_dir = RunPaths(run_dir).sandboxes, RunPaths(run_dir).records
        self.on_resume, self.max_continues = c.on_resume, c.max_continues
        self.start_budget_s = c.start_budget_s
        self.proxy: ProxyAdmin | None = None
        self.proxy_url = ""
        self.queue: list[Execution] = []
        self.running: list[Execution] = []
        self.num_unstarted: int | None = 0
        """Executions ended without a model call before any made one (None: one has)."""
        self.num_first = c.groups_per_step * c.group_size

    def attach(self, proxy: ProxyAdmin, proxy_url: str) -> None:
        self.proxy, self.proxy_url = proxy, proxy_url

    async def advance(self, version: int, free_slots: int) -> None:
        self.admit_held_out(version)
        self.admit_groups(version)
        await self.start_queued(free_slots)
        await self.collect()

    # ---- admission ---------------------------------------------------------------------------
    def admit_groups(self, version: int) -> None:
        """Draw the groups the staleness bound lets start under weight version `version`, once no
        held-out execution is queued or running (those run alone, under the weights they evaluate)."""
        if any(ex.held_out is not None for ex in self.queue + self.running):
            return
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

    def admit_held_out(self, version: int) -> None:
        """Queue every held-out task under each version of `held_out_at` (no group starts meanwhile)."""
        if not self.held_out_tasks or version not in self.held_out_at or version in self.held_out_versions:
            return
        self.held_out_versions.add(version)
        self.queue[:0] = [
            Execution(f"heldout-v{version:04d}-{t.task_id}-{i}", -1, t, held_out=version)
            for t in self.held_out_tasks
            for i in range(self.held_out_samples)
        ]

    def held_out_pending(self) -> bool:
        """Held-out rollouts still to admit under the last weights, queued or running."""
        return bool(self.held_out_tasks) and (
            self.num_steps not in self.held_out_versions
            or any(ex.held_out is not None for ex in self.queue + self.running)
        )

    def done(self, train) -> bool:
        """Every step trained and checkpointed, and the held-out tasks evaluated under the last weights."""
        return super().done(train) and not self.held_out_pending()

    def restore(self, view: LedgerView, version: int) -> None:
        """Rebuild the groups not yet trained under the restored weights (`version`) from the ledger.

        Rule for executions in flight at the checkpoint: an execution with an outcome keeps it (its
        records and score are durable); one without continues its harness session under the same
        id (`_continuable`), or else is marked excluded (interrupted) and re-run as a new attempt,
        so none is lost and none is trained twice.
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
        done = view.outcome(eid)
        if done is not None:
            return recorded(done, g, self.records_dir)
        ex = Execution(eid, g.index, g.task)
        if (used := self._continuable(view.history[eid], g)) is not None:
            ex.used_s, kept = used, self._tokens_before_break(eid)
            self._log(ex, "queued", reason="continued", duration_s=used, tokens_kept=kept)
            self.queue.append(ex)
            return ex
        self._log(ex, "excluded", reason="interrupted")
        retry = Execution(f"{execution_id}.r{attempt + 1}", g.index, g.task)
        self._log(retry, "queued")
        self.queue.append(retry)
        return retry

    def _continuable(self, history: list[LedgerEntry], g: Group) -> float | None:
        """The time budget an interrupted execution used before the break, if it continues its
        harness session (coordinator.on_resume, its harness and task allow it, fewer than
        coordinator.max_continues so far); None: it is re-run instead."""
        eid = history[0].execution_id
        continued = [e for e in history if e.state == "queued" and e.reason == "continued"]
        if self.on_resume != "continue" or len(continued) >= self.max_continues:
            return None
        if (why := continuable(g.task, self.harness, self.sandbox_root / eid)) is not None:
            log.info("execution %s is re-run: %s", eid, why)
            return None
        started = [e.t for e in history if e.state == "running"]
        if not started:
            return None
        records = record_path(self.records_dir, eid)
        last_alive = records.stat().st_mtime if records.exists() else started[-1]  # its last call's record
        before = continued[-1].duration_s if continued else 0.0
        return before + max(0.0, last_alive - started[-1])

    def _tokens_before_break(self, eid: str) -> int:
        try:
            records, _ = read_records(record_path(self.records_dir, eid))
        except (OSError, RecordFileError):
            return 0
        return sum(len(r.input_ids) + len(r.output_ids) for r in records)

    # ---- running ------------------------------------------------------------------------------
    async def start_queued(self, free_slots: int) -> None:
        """Start queued executions, oldest first, into `free_slots` session slots, for at most
        coordinator.start_budget_s (one at least): the rest start in the next turns of the loop."""
        t0, tried = time.monotonic(), 0
        while self.queue and free_slots > 0 and (not tried or time.monotonic() - t0 < self.start_budget_s):
            ex = self.queue.pop(0)
            free_slots, tried = free_slots - 1, tried + 1
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
                if ex.used_s is None:
                    await asyncio.to_thread(ex.sandbox.prepare)
                else:
                    ex.sandbox.resume(ex.used_s)
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
        ended = await asyncio.gather(*(self._evaluate(ex, r) for ex, r in done))
        return [ex for (ex, _), end in zip(done, ended, strict=True) if end]

    async def _evaluate(self, ex: Execution, result) -> bool:
        """Score the workspace, unless the policy never acted: a harness that made no model call
        (exited at once, crashed on start, did the work itself, or was stopped at its time budget
        before a call ended) is excluded, never scored; a timed-out run without partial credit is
        excluded as budget_exhausted (evaluate, settle_budget). A multi-step task's step is verified
        and its next step started (running again: False), its last one's evaluation is its steps'."""
        steps_ev = None
        if ex.sandbox.task.steps:
            steps_ev = await asyncio.to_thread(finish_step, ex.sandbox, result)
            if steps_ev is None:
                self.running.append(ex)
                return False
        outcome = "timed_out" if result.timed_out else "finished"
        ex.duration_s = result.duration_s
        try:
            await self.proxy.revoke_execution(ex.execution_id)
        except Exception as e:  # a revoke that fails leaves a key valid, nothing else
            log.warning("revoking %s: %s", ex.execution_id, e)
        if (reason := unscored_reason(result.exit_code, has_records(ex.records_path), result.timed_out)) is not None:
            await asyncio.to_thread(ex.sandbox.close)
            ex.evaluation = Evaluation(reason if reason in OUTCOMES else outcome, None, reason)
            self._log(ex, "excluded", reason=reason, duration_s=ex.duration_s, exit_code=result.exit_code)
            if self.num_unstarted is not None:
                self.num_unstarted += 1
                check_harness_started(self.num_unstarted, self.num_first, self.harness.kind, result.log_path, reason)
            return True
        self.num_unstarted = None
        try:  # a Harbor task is verified in its agent's environment, ended once verified
            ev = steps_ev
            if ev is None:
                ev = await asyncio.to_thread(
                    evaluate, ex.sandbox.task, result.workspace, outcome, ex.sandbox.environment
                )
        finally:
            await asyncio.to_thread(ex.sandbox.close)
        ex.evaluation = ev
        if ev.outcome in HARNESS_OUTCOMES and ev.score is not None:
            self._log(
                ex,
                ev.outcome,
                score=ev.score,
                duration_s=ex.duration_s,
                exit_code=result.exit_code,
                metrics=ev.metrics or None,
            )
        else:
            reason = "no_score" if ev.outcome in HARNESS_OUTCOMES else ev.outcome
            self._log(ex, "excluded", reason=reason, duration_s=ex.duration_s, exit_code=result.exit_code)
        return True

    def counts(self, version: int) -> tuple[int, int, int, int]:
        """(queued, of those for later steps than `version`, running, of those for later steps)."""

        def ahead(executions: list[Execution]) -> int:
            return sum(1 for ex in executions if ex.held_out is None and self.groups[ex.group].step > version)

        return len(self.queue), ahead(self.queue), len(self.running), ahead(self.running)

    def close(self) -> None:
        for ex in self.running:
            ex.sandbox.kill()


class RolloutsOnly(Rollouts):
    """mode=rollout: executions are evaluated and recorded, never trained; every step's groups may start at once."""

    def __init__(self, cfg: GyreConfig, run_dir: Path, taskset: TaskSource, ledger: ExecutionLedger, events=None):
        super().__init__(cfg, run_dir, taskset, ledger, events)
        self.staleness, self.held_out_tasks = cfg.num_steps, []

    def feed(self, train) -> None:
        for group in self.ready_groups():
            group.batched = True

    def done(self, train) -> bool:
        """Every group drawn and evaluated."""
        return self.next_group >= self.num_steps * self.groups_per_step and all(g.batched for g in self.groups.values())
