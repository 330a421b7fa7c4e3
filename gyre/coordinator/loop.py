"""The coordinator's entry loop: one elastic RL run, start to summary.

    observe ─> decide ─> switch ─> admit ─> collect + evaluate ─> batch ─> train ─> publish ─> checkpoint
       ^                                                                                     │
       └──────────────────────────────── every tick_s ───────────────────────────────────────┘

Everything here is wiring: building processes is gyre.coordinator.build, groups come from the
mode's Source (gyre.coordinator.source: live rollouts or a replay), batches and steps are
gyre.coordinator.training, the decisions are the scheduler's pure policy over
gyre.scheduler.observe.make_observation.
"""

import asyncio
import logging
import threading
import time
from pathlib import Path

import aiohttp

from gyre.cells.base import CellError
from gyre.common.run_paths import RunPaths
from gyre.control.messages import CheckpointDone, Failure, PhaseDone, RoleDone, StepDone, StepProgress
from gyre.coordinator.build import Parts, build, close
from gyre.coordinator.config import GyreConfig
from gyre.coordinator.ledger import ExecutionLedger, read_ledger
from gyre.coordinator.replay import ReplaySource
from gyre.coordinator.rollouts import Rollouts, RolloutsOnly
from gyre.coordinator.source import Source
from gyre.coordinator.summary import RunEvents
from gyre.coordinator.training import Training
from gyre.engines.published import PublishedWeights
from gyre.engines.weights import serve_weights
from gyre.errors import GyreError
from gyre.scheduler.cells import Role
from gyre.scheduler.decode import EngineLoads, measure_cells
from gyre.scheduler.observe import make_observation
from gyre.scheduler.policy import Observation
from gyre.tasks.taskset import TaskSource

log = logging.getLogger(__name__)


class RunFailed(GyreError):
    """A cell reported a failure the run cannot continue from."""


class Preempted(GyreError):
    """The run stopped on a preemption signal with every finished step checkpointed: resume continues it."""


_SOURCES = {"train": Rollouts, "rollout": RolloutsOnly, "replay": ReplaySource}
"""Each mode's source (RUN_MODES): what differs between modes is there, not in the loop."""


async def run(
    cfg: GyreConfig, run_dir: Path, taskset: TaskSource, resume: bool = False, preempt: threading.Event | None = None
) -> dict:
    """Run `cfg.num_steps` RL steps into `run_dir` (cfg.mode: train, replay or rollout); returns the summary.

    Once `preempt` is set, the next finished step is checkpointed even off `checkpoint_every_steps`,
    and the loop raises Preempted as soon as no finished step is left uncheckpointed (the step in
    progress is given up: resume re-runs it from the ledger). Everything is closed on the way out.
    """
    t_start = time.time()
    view = read_ledger(RunPaths(run_dir).ledger)
    ledger, events = ExecutionLedger(RunPaths(run_dir).ledger), RunEvents(run_dir, cfg)
    source: Source = _SOURCES[cfg.mode](cfg, run_dir, taskset, ledger, events)
    parts = None
    try:
        parts = await build(cfg, run_dir, resume)
        events.start(parts.initial, [x.state.role.value for x in parts.cells])
        train = _training(cfg, parts)
        source.attach(parts.admin, parts.proxy.url)
        if resume:
            source.restore(view, train.version)
        while not source.done(train):
            await _tick(cfg, parts, train, source, events, preempt is not None and preempt.is_set())
            await asyncio.sleep(cfg.coordinator.tick_s)
    except Preempted:
        raise
    except BaseException as e:
        events.failure("coordinator", repr(e))
        raise
    else:
        kv = await parts.admin.metrics()
        return events.summary(read_ledger(RunPaths(run_dir).ledger), time.time() - t_start, train.version) | {
            "cpu_quota": parts.launcher.describe(),
            "kv_migrated_tokens": kv["kv_migrated_tokens"],
            "kv_reprefill_tokens": kv["kv_reprefill_tokens"],
        }
    finally:
        source.close()
        if parts is not None:
            await close(parts)
        ledger.close()
        events.close()


def _training(cfg: GyreConfig, parts: Parts) -> Training:
    c = cfg.coordinator
    return Training(
        groups_per_step=c.groups_per_step,
        staleness=cfg.scheduler.staleness,
        trajectory=cfg.trajectory,
        max_tokens=c.max_micro_batch_tokens,
        version=parts.initial.step,
        train_tok_s=c.train_tok_s,
        weights=parts.initial.weights,
        replicas=cfg.cluster.ranks_per_cell // cfg.trainer.tensor_parallel_size,
    )


async def _tick(
    cfg: GyreConfig, parts: Parts, train: Training, source: Source, events: RunEvents, preempting: bool
) -> None:
    """One turn: the cells' messages, then observe, decide, switch, admit, collect, batch and send."""
    now = time.time()
    for cell in parts.cells:
        for msg in _poll(cell, parts, events, now):
            if cell.state.role == Role.LOST:  # by an earlier message of this batch
                break
            await _on_message(msg, cell, parts, train, source, events, cfg, now, preempting)
    if preempting and not train.uncheckpointed:
        raise Preempted(f"preempted at weight version {train.version}, its checkpoint complete")
    obs, loads = await observe(cfg, parts, train, source, now)
    events.observe(obs, loads.sessions)
    decision = parts.policy.decide(obs)
    for i in decision.to_train + decision.to_rollout:
        target = Role.TRAIN if i in decision.to_train else Role.ROLLOUT
        parts.cells[i].begin_switch(target, now, train.weights, parts.core_address)
    serving = sum(m for x, m in zip(parts.cells, loads.max_sessions) if x.state.role == Role.ROLLOUT)
    await source.advance(train.version, serving - obs.running)
    source.feed(train)
    if parts.core.state.role == Role.TRAIN:
        for msg in train.to_send():
            parts.core.state.join_step(msg.step)
            parts.core.channel.send(msg)
    events.update()


async def observe(
    cfg: GyreConfig, parts: Parts, train: Training, source: Source, now: float
) -> tuple[Observation, EngineLoads]:
    """What the policy sees now: the source's queue, the proxy's sessions and decode counters per
    cell (measured over coordinator.decode_window_s), the trainer's ready work."""
    queued, queued_ahead, running, running_ahead = source.counts(train.version)
    engines = (await parts.admin.metrics())["engines"]
    c = cfg.coordinator
    loads = measure_cells(now, [x.engine_ids for x in parts.cells], engines, parts.decode, c.sessions_per_cell)
    obs = make_observation(
        now,
        [x.state for x in parts.cells],
        loads.sessions,
        loads.max_sessions,
        loads.gen_tok_s,
        queued=queued,
        queued_ahead=queued_ahead,
        running=running,
        running_ahead=running_ahead,
        work=train,
        train_tok_s=train.train_tok_s,
        optimizing=train.optimizing,
        gen_demand_tok_s=loads.gen_demand_tok_s,
    )
    return obs, loads


def _poll(cell, parts: Parts, events: RunEvents, now: float) -> list:
    """A cell's new messages. A satellite that died is marked lost and the run goes on without it (the
    proxy's health check reroutes its sessions, the core takes back its micro-steps); losing the core
    ends the run, which resumes from its checkpoint."""
    if cell.state.role == Role.LOST:
        return []
    try:
        cell.check_alive()
        return cell.messages()
    except CellError as e:
        if cell is parts.core:
            raise
        _lose(cell, events, now, str(e))
        return []


def _lose(cell, events: RunEvents, now: float, reason: str) -> None:
    """Mark a satellite lost; it is stopped off the loop (closing a channel to a peer not yet known
    dead waits out its timeout under MPI)."""
    log.warning("cell %d lost: %s", cell.index, reason)
    cell.state.lose(now)
    events.failure(f"cell{cell.index}", f"lost: {reason[:2000]}")
    threading.Thread(target=cell.stop, daemon=True, name=f"stop-cell{cell.index}").start()


async def _on_message(
    msg,
    cell,
    parts: Parts,
    train: Training,
    source: Source,
    events: RunEvents,
    cfg: GyreConfig,
    now: float,
    preempting: bool,
) -> None:
    if isinstance(msg, PhaseDone):
        cell.on_phase(msg, now)
    elif isinstance(msg, RoleDone):
        events.role_switch(msg)
        if msg.role == Role.ROLLOUT.value and await _behind(cell, train.version, parts):
            await _load_serving([cell], train.weights, parts, events, now)  # published while the cell was switching
    elif isinstance(msg, StepProgress):
        train.on_progress(msg)
    elif isinstance(msg, StepDone):
        rec = train.on_step_done(msg, sum(x.state.role == Role.TRAIN for x in parts.cells))
        parts.core.state.leave_step()
        events.step(rec)
        t0, serving = time.monotonic(), [x for x in parts.cells if x.state.role == Role.ROLLOUT]
        await _load_serving(serving, msg.weights, parts, events, now)
        events.publish(train.version, time.monotonic() - t0, len(serving))
        if (
            train.version % cfg.coordinator.checkpoint_every_steps == 0
            or train.version >= source.num_steps
            or preempting
        ):
            parts.core.channel.send(train.checkpoint({"next_group": source.next_group}))
    elif isinstance(msg, CheckpointDone):
        events.checkpoint(msg)
        for rec in train.on_checkpoint_done(msg):
            for group, batch in rec.groups:
                source.mark_trained(group, {eid for mb in batch.micro_batches for eid in mb.execution_ids}, rec.step)
    elif isinstance(msg, Failure):  # a satellite's is its loss (as its death is); the core's ends the run
        if cell is parts.core:
            raise RunFailed(f"cell {msg.cell}: {msg.reason}")
        _lose(cell, events, now, f"failed: {msg.reason}")


async def _load_serving(cells: list, weights: PublishedWeights, parts: Parts, events: RunEvents, now: float) -> None:
    """Have serving cells load `weights`. A satellite whose engine cannot be reached is lost: its
    leader may be dead before its channel says so (MPI finds a dead peer only by its silence)."""
    results = await asyncio.gather(*(_load_newest(x, weights, parts) for x in cells), return_exceptions=True)
    for cell, result in zip(cells, results):
        if (
            isinstance(result, (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError))
            and cell is not parts.core
        ):
            _lose(cell, events, now, f"its engine did not take weight version {weights.version}: {result!r}")
        elif isinstance(result, BaseException):
            raise result


async def _load_newest(cell, weights: PublishedWeights, parts: Parts) -> None:
    """Have every engine of a serving cell serve the newest published weights, side by side."""
    serving = (serve_weights(e, eid, parts.admin, weights) for e, eid in zip(cell.engines, cell.engine_ids))
    for result in await asyncio.gather(*serving, return_exceptions=True):
        if isinstance(result, BaseException):
            raise result


async def _behind(cell, version: int, parts: Parts) -> bool:
    """Whether an engine of `cell` serves a version older than `version` (the proxy keeps what each serves)."""
    served = await parts.admin.served_versions()
    return any(served.get(eid) is None or served[eid] < version for eid in cell.engine_ids)
