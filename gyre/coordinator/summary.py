"""What the coordinator tells people: typed events into the run's events.jsonl (gyre.metrics), the
live views built from them (progress, TensorBoard, figures), and the run's summary."""

import dataclasses
from pathlib import Path

import numpy as np

from gyre.control.messages import CellReady, CheckpointDone, RoleDone
from gyre.coordinator.ledger import LedgerEntry, LedgerView
from gyre.metrics.events import (
    Checkpoint,
    Exclusion,
    ExecutionState,
    FailureEvent,
    HeldOutResult,
    ObservationEvent,
    OptimizerStep,
    RoleSwitchEvent,
    RunStart,
    WeightPublish,
)
from gyre.metrics.log import EventLog
from gyre.metrics.monitor import RunMonitor
from gyre.metrics.report import format_steps


class RunEvents:
    """The coordinator's emitter and monitor (one per run process)."""

    def __init__(self, run_dir: Path, cfg):
        self.cfg, self.run_dir = cfg, run_dir
        self.log = EventLog(run_dir)
        self.monitor = RunMonitor(run_dir, cfg.metrics, num_steps=cfg.num_steps)
        self._roles: dict[int, str] = {}
        self._observed_at = 0.0

    def start(self, ready: CellReady, roles: list[str]) -> None:
        self._roles = dict(enumerate(roles))
        self.log.emit(
            RunStart(
                mode=self.cfg.scheduler.mode,
                num_steps=self.cfg.num_steps,
                num_cells=len(roles),
                cell_ranks=self.cfg.cluster.ranks_per_cell,
                start_step=ready.step,
                weights_digest=ready.weights_digest,
            )
        )

    def execution_state(self, entry: LedgerEntry, step: int) -> None:
        self.log.emit(
            ExecutionState(
                execution_id=entry.execution_id,
                task_id=entry.task_id,
                group_id=str(entry.group),
                step=step,
                state=entry.state,
                reason=entry.reason or None,
                reward=entry.score,
                duration_s=entry.duration_s,
                tokens_kept=entry.tokens_kept,
            )
        )
        if entry.state == "excluded":
            self.log.emit(Exclusion(execution_id=entry.execution_id, reason=entry.reason))

    def held_out(self, ex) -> None:
        """A held-out execution's result (gyre.coordinator.source.Execution with its evaluation)."""
        ev = ex.evaluation
        self.log.emit(
            HeldOutResult(
                execution_id=ex.execution_id,
                task_id=ex.task.task_id,
                version=ex.held_out,
                outcome=ev.outcome,
                reward=ev.score,
            )
        )

    def observe(self, obs, sessions: list[int]) -> None:
        if obs.now_s - self._observed_at < 1.0:
            return
        self._observed_at = obs.now_s
        self.log.emit(
            ObservationEvent(
                queued=obs.queued,
                running=obs.running,
                roles=[c.role.value for c in obs.cells],
                sessions=sessions,
                gen_tok_s=[round(c.gen_tok_s, 1) for c in obs.cells],
                gen_demand_tok_s=round(obs.gen_demand_tok_s, 1),
            )
        )

    def role_switch(self, msg: RoleDone) -> None:
        self.log.emit(
            RoleSwitchEvent(
                cell=msg.cell,
                from_role=self._roles.get(msg.cell, ""),
                to_role=msg.role,
                t_start=msg.t_start,
                phases=msg.phases,
                rank_phases=msg.rank_phases,
            )
        )
        self._roles[msg.cell] = msg.role

    def step(self, rec) -> None:
        m, r = rec.metrics, rec.rewards
        counts = {}
        for _, batch in rec.groups:
            for k, v in dataclasses.asdict(batch.counts).items():
                counts[k] = counts.get(k, 0) + v
        self.log.emit(
            OptimizerStep(
                step=rec.step,
                loss=m.get("loss", 0.0),
                clip_fraction=m.get("clip_fraction", 0.0),
                truncated_fraction=m.get("truncated_fraction", 0.0),
                ratio_mean=m.get("ratio_mean", 1.0),
                logprob_gap_mean=m.get("logprob_gap_mean", 0.0),
                entropy_mean=m.get("entropy_mean"),
                kl_mean=m.get("kl_mean"),
                grad_norm=m.get("grad_norm", 0.0),
                reward_mean=float(np.mean(r)) if r else 0.0,
                reward_std=float(np.std(r)) if r else 0.0,
                num_executions=len(r),
                seconds=rec.seconds,
                **counts,
            )
        )

    def publish(self, version: int, seconds: float, num_engines: int) -> None:
        self.log.emit(WeightPublish(version=version, seconds=seconds, num_engines=num_engines))

    def checkpoint(self, msg: CheckpointDone) -> None:
        self.log.emit(Checkpoint(step=msg.step, path=msg.path, seconds=msg.seconds, weights_digest=msg.weights_digest))

    def failure(self, component: str, message: str) -> None:
        self.log.emit(FailureEvent(component=component, message=message))

    def update(self) -> None:
        self.monitor.update()

    def summary(self, view: LedgerView, wall_s: float, version: int) -> dict:
        """The monitor's figures, with the ledger's counts (the durable truth) and the run's totals."""
        state = self.monitor.state
        out, self.monitor = self.monitor.close(), None
        print(format_steps(state), flush=True)
        return out | {
            "num_steps": version,
            "executions": dict(view.counts()),
            "wall_s": round(wall_s, 1),
            "run_dir": str(self.run_dir),
        }

    def close(self) -> None:
        self.log.close()
        if self.monitor is not None:
            self.monitor.close()
