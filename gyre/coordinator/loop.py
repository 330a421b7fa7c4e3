"""The coordinator's entry loop: one elastic RL run, start to summary.

    observe ─> decide ─> switch ─> admit ─> collect + evaluate ─> batch ─> train ─> publish ─> checkpoint
       ^                                                                                     │
       └──────────────────────────────── every tick_s ───────────────────────────────────────┘

Everything here is wiring: building processes is gyre.coordinator.build, executions are
gyre.coordinator.rollouts, batches and steps gyre.coordinator.training, the decisions are the
scheduler's pure policy over gyre.scheduler.observe.make_observation.
"""

import asyncio
import logging
import time
from pathlib import Path

from gyre.cells.protocol import CellFailure, CheckpointDone, PhaseDone, RoleDone, StepDone, recv, send
from gyre.config import GyreConfig
from gyre.coordinator.build import Parts, build, close
from gyre.coordinator.ledger import ExecutionLedger, LedgerEntry, read_ledger
from gyre.coordinator.rollouts import Rollouts
from gyre.coordinator.summary import RunEvents
from gyre.coordinator.training import Training
from gyre.errors import GyreError
from gyre.scheduler.cells import Role
from gyre.scheduler.observe import make_observation

log = logging.getLogger(__name__)


class RunFailed(GyreError):
    """A cell reported a failure the run cannot continue from."""


async def run(cfg: GyreConfig, run_dir: Path, taskset, resume: bool = False) -> dict:
    """Run `cfg.num_steps` RL steps into `run_dir`; returns the summary."""
    t_start = time.time()
    view = read_ledger(run_dir / "ledger.jsonl")
    ledger, events = ExecutionLedger(run_dir / "ledger.jsonl"), RunEvents(run_dir, cfg)
    parts = await build(cfg, run_dir, resume)
    events.start(parts.initial)
    c = cfg.coordinator
    try:
        train = Training(groups_per_step=c.groups_per_step, staleness=cfg.scheduler.staleness, trajectory=cfg.trajectory,
                         max_tokens=c.max_micro_batch_tokens, version=parts.initial.step, train_tok_s=c.train_tok_s)
        train.weights = parts.initial.weights
        rollouts = Rollouts(taskset=taskset, harness=cfg.harness, group_size=c.group_size, groups_per_step=c.groups_per_step,
                            num_steps=cfg.num_steps, staleness=cfg.scheduler.staleness, seed=cfg.seed,
                            model=cfg.proxy.model_names[0], run_dir=run_dir, ledger=ledger, proxy=parts.admin,
                            proxy_url=parts.proxy.url, records_dir=run_dir / "records")  # fmt: skip
        if resume:
            rollouts.restore(view, train.version)
        while train.version < cfg.num_steps or train.uncheckpointed:
            now = time.time()
            for cell in parts.cells:
                cell.check_alive()
                while cell.conn.poll():
                    await _on_message(recv(cell.conn), cell, parts, train, rollouts, ledger, events, cfg, now)
            queued, ahead, running = rollouts.counts(train.version)
            obs = make_observation(
                now, [x.state for x in parts.cells], _sessions(parts, running), [c.sessions_per_cell] * len(parts.cells),
                [1.0] * len(parts.cells), queued=queued, queued_ahead=ahead, running=running, queue=train.queue,
                train_tok_s=train.train_tok_s, optimizing=train.in_flight is not None)  # fmt: skip
            events.observe(obs)
            decision = parts.policy.decide(obs)
            for i in decision.to_train + decision.to_rollout:
                target = Role.TRAIN if i in decision.to_train else Role.ROLLOUT
                parts.cells[i].begin_switch(target, now, train.weights, parts.core_address)
            rollouts.admit_groups(train.version)
            serving = sum(x.state.role == Role.ROLLOUT for x in parts.cells)
            await rollouts.start_queued(serving * c.sessions_per_cell - running)
            for ex in await rollouts.collect():
                events.execution(ex)
            for group in rollouts.ready_groups():
                batch = train.add_group(group)
                rollouts.log_exclusions(group, batch.excluded)
                events.group(group, batch)
            if parts.core.state.role == Role.TRAIN and (step := train.next_step()) is not None:
                parts.core.state.join_step(step.step)
                send(parts.core.conn, step)
            events.progress(train, rollouts, parts)
            await asyncio.sleep(c.tick_s)
    except BaseException as e:
        events.failure("coordinator", repr(e))
        raise
    else:
        return events.summary(read_ledger(run_dir / "ledger.jsonl"), time.time() - t_start, train.version)
    finally:
        rollouts.close() if "rollouts" in locals() else None
        await close(parts)
        ledger.close()
        events.close()


def _sessions(parts: Parts, running: int) -> list[int]:
    """Live sessions per cell, as the proxy routes them (executions split evenly until it reports)."""
    serving = [x for x in parts.cells if x.state.role == Role.ROLLOUT]
    return [running // max(1, len(serving)) if x in serving else 0 for x in parts.cells]


async def _on_message(msg, cell, parts: Parts, train: Training, rollouts: Rollouts, ledger: ExecutionLedger,
                      events: "RunEvents", cfg: GyreConfig, now: float) -> None:  # fmt: skip
    if isinstance(msg, PhaseDone):
        cell.on_phase(msg, now)
    elif isinstance(msg, RoleDone):
        events.role_switch(msg)
        if msg.role == Role.ROLLOUT.value and cell.engine_version < train.version:
            await _load_newest(cell, train.weights)
        cell.engine_version = max(cell.engine_version, (train.weights or {}).get("version", -1))
    elif isinstance(msg, StepDone):
        rec = train.on_step_done(msg, sum(x.state.role == Role.TRAIN for x in parts.cells))
        parts.core.state.leave_step()
        events.step(rec, train)
        await asyncio.gather(*(_load_newest(x, msg.weights) for x in parts.cells if x.state.role == Role.ROLLOUT))
        if train.version % cfg.coordinator.checkpoint_every_steps == 0 or train.version >= cfg.num_steps:
            send(parts.core.conn, train.checkpoint({"next_group": rollouts.next_group}))
    elif isinstance(msg, CheckpointDone):
        events.checkpoint(msg)
        for rec in train.on_checkpoint_done(msg):
            for group, batch in rec.groups:
                trained = {eid for mb in batch.micro_batches for eid in mb.execution_ids}
                for eid in sorted(trained):
                    ledger.append(LedgerEntry(eid, "trained", time.time(), group=group.index, step=rec.step))
    elif isinstance(msg, CellFailure):
        raise RunFailed(f"cell {msg.cell}: {msg.message}")


async def _load_newest(cell, weights: dict) -> None:
    """Have a serving cell's engine load the newest published weights (Mooncake read from the core)."""
    from gyre.engines.client import EngineClient

    w = dict(weights)
    version = w.pop("version")
    async with EngineClient(cell.engine_url) as engine:
        await engine.update_weights_from_tensor(weight_version=str(version), load_format="gyre_transfer", **w)
    cell.engine_version = version
