"""What the coordinator tells people: events to the run directory, a progress line, the summary."""

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from gyre.cells.protocol import CheckpointDone, RoleDone
from gyre.coordinator.ledger import LedgerView


class RunEvents:
    """Appends one JSON line per event to `events.jsonl` and keeps what the summary needs."""

    def __init__(self, run_dir: Path, cfg, progress_every_s: float = 5.0):
        self.cfg, self.run_dir = cfg, run_dir
        self._fd = os.open(run_dir / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.rewards: dict[int, list[float]] = {}
        self.switches: list[RoleDone] = []
        self.role_time: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._last_roles: dict[int, tuple[str, float]] = {}
        self._last_progress = 0.0
        self.progress_every_s = progress_every_s
        self.t0 = time.time()
        self.obs = None

    def emit(self, kind: str, **fields) -> None:
        os.write(self._fd, (json.dumps({"kind": kind, "t": time.time(), **fields}) + "\n").encode())

    def observe(self, obs) -> None:
        self.obs = obs
        for c in obs.cells:
            role, since = self._last_roles.get(c.index, (c.role.value, obs.now_s))
            self.role_time[c.index][role] += obs.now_s - since
            self._last_roles[c.index] = (c.role.value, obs.now_s)
        self.emit("observation", queued=obs.queued, running=obs.running, roles=[c.role.value for c in obs.cells])

    def execution(self, ex) -> None:
        ev = ex.evaluation
        self.emit("execution", execution_id=ex.execution_id, group=ex.group, state=ex.state, outcome=ev.outcome,
                  score=ev.score, duration_s=ex.duration_s)

    def group(self, group, batch) -> None:
        self.emit("group", group=group.index, step=group.step, rewards=batch.rewards, excluded=batch.excluded,
                  num_micro_batches=len(batch.micro_batches), tokens_naive=batch.counts.targets_naive,
                  tokens_capped=batch.counts.targets_capped, tokens_dedup=batch.counts.targets_dedup,
                  masked_targets=batch.num_masked_targets)

    def role_switch(self, msg: RoleDone) -> None:
        self.switches.append(msg)
        self.emit("role_switch", cell=msg.cell, to_role=msg.role, t_start=msg.t_start, phases=msg.phases)

    def step(self, rec, train) -> None:
        self.rewards[rec.step] = rec.rewards
        r = rec.rewards
        self.emit("optimizer_step", step=rec.step, seconds=rec.seconds, reward_mean=float(np.mean(r)) if r else None,
                  reward_std=float(np.std(r)) if r else None, **{k: v for k, v in rec.metrics.items()
                                                                   if isinstance(v, (int, float))})

    def checkpoint(self, msg: CheckpointDone) -> None:
        self.emit("checkpoint", step=msg.step, path=msg.path, seconds=msg.seconds, weights_digest=msg.weights_digest)

    def start(self, ready) -> None:
        self.emit("start", step=ready.step, weights_digest=ready.weights_digest)

    def failure(self, component: str, message: str) -> None:
        self.emit("failure", component=component, message=message)

    def progress(self, train, rollouts, parts) -> None:
        now = time.time()
        if now - self._last_progress < self.progress_every_s or self.obs is None:
            return
        self._last_progress = now
        last = self.rewards.get(train.version - 1)
        reward = f"{np.mean(last):.3f}" if last else "-"
        roles = " ".join(f"{c.index}:{c.role.value}" for c in self.obs.cells)
        print(f"[{now - self.t0:6.0f}s] step {train.version}/{self.cfg.num_steps} waterlevel {self.obs.waterlevel} "
              f"(queued {self.obs.queued}, running {self.obs.running}) cells {roles} reward {reward}",
              file=sys.stderr, flush=True)

    def summary(self, view: LedgerView, wall_s: float, version: int) -> dict:
        """The run's figures; `version` is the weight version reached (steps, resumed ones included)."""
        steps = sorted(self.rewards)
        means = [float(np.mean(self.rewards[s])) for s in steps if self.rewards[s]]
        phases = defaultdict(list)
        for sw in self.switches:
            for p, secs in sw.phases.items():
                phases[p].append(secs)
        share = {}
        for cell, roles in sorted(self.role_time.items()):
            total = sum(roles.values()) or 1.0
            share[str(cell)] = {r: round(v / total, 3) for r, v in roles.items()}
        return {
            "num_steps": version, "executions": dict(view.counts()),
            "reward_first3": float(np.mean(means[:3])) if means else None,
            "reward_last3": float(np.mean(means[-3:])) if means else None,
            "reward_per_step": [round(m, 4) for m in means],
            "num_role_switches": len(self.switches),
            "switch_phase_s": {p: round(float(np.mean(v)), 4) for p, v in phases.items()},
            "role_share": share, "wall_s": round(wall_s, 1), "run_dir": str(self.run_dir),
        }

    def close(self) -> None:
        os.close(self._fd)
