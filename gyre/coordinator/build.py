"""Building and closing a run's processes: the proxy, the cell leaders (each with its engine), tokens.

    build: proxy ─> cell listener ─> cell leaders (quota'd) ─> CellReady ─> engines registered (each under its cell),
           version-0 weights (or the checkpoint's) pushed from the core to every engine
    close: sandboxes killed ─> leaders stopped (their engines with them) ─> proxy stopped

Everything started here is stopped by `close`, also after a failure half way through `build`.
Where leaders run is the launcher's business (`cluster.backend`): local child processes
(gyre.cells.local) or the tasks of the het job this coordinator runs in (gyre.cells.slurm);
both hand out cells with one interface (gyre.cells.base.BaseCell).
"""

import asyncio
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from gyre.cells.base import BaseCell, CellError, CellLauncher
from gyre.cells.local import LocalLauncher
from gyre.cells.spec import CellSpec
from gyre.common.run_paths import RunPaths
from gyre.common.wait import wait_until
from gyre.control.messages import CellReady
from gyre.control.transport import ChannelClosed, ChannelTimeout, Listener, listen
from gyre.coordinator.config import GyreConfig
from gyre.engines.weights import serve_weights
from gyre.proxy.admin import ProxyAdmin
from gyre.proxy.main import ProxyProcess
from gyre.scheduler.cells import Role, make_cells
from gyre.scheduler.decode import DecodeMeter
from gyre.scheduler.policy import BasePolicy, Decision, make_policy

log = logging.getLogger(__name__)


class RolloutOnlyPolicy(BasePolicy):
    """mode=rollout: every cell serves rollouts and none ever switches."""

    def initial_roles(self) -> list[Role]:
        return [Role.ROLLOUT] * self.num_cells

    def decide(self, obs) -> Decision:
        return Decision()


@dataclass
class Parts:
    """The run's live processes and the handles the loop drives them with."""

    run_dir: Path
    proxy: ProxyProcess
    admin: ProxyAdmin
    launcher: CellLauncher | None = None
    """Makes the cells (local processes or this job's Slurm tasks), says how they were placed."""
    cells: list[BaseCell] = field(default_factory=list)
    policy: BasePolicy | None = None
    decode: DecodeMeter | None = None
    """Decode speed, demand and capacity from the proxy's counters (the live Observation's decode terms)."""
    listener: Listener | None = None
    core_address: str = ""
    initial: CellReady | None = None
    """The core's CellReady: its step (weight version) and published weights."""

    @property
    def core(self) -> BaseCell:
        return self.cells[0]


def make_launcher(cfg: GyreConfig, run_dir: Path) -> CellLauncher:
    """The launcher of `cfg.cluster.backend`; the Slurm one only inside the run's het job (gyre.launch.job)."""
    if cfg.cluster.backend == "local":
        return LocalLauncher(run_dir, cfg.coordinator.cpus_per_cell, cfg.cluster.bind_host)
    from gyre.cells.placement import current_placement
    from gyre.cells.slurm import SlurmLauncher

    return SlurmLauncher(RunPaths(run_dir).slurm, current_placement(), cfg.cluster.bind_host)


async def build(cfg: GyreConfig, run_dir: Path, resume: bool) -> Parts:
    """Start every process of a run; on failure whatever started is stopped and the error raised."""
    RunPaths(run_dir).logs.mkdir(parents=True, exist_ok=True)
    launcher = make_launcher(cfg, run_dir)
    proxy_cfg = dataclasses.replace(
        cfg.proxy,
        host=launcher.proxy_host(cfg.proxy.host),
        records_dir=str(RunPaths(run_dir).records),
        events_dir=str(run_dir),
        vocab_size=cfg.model.vocab_size,
        rebalance_on_return=cfg.scheduler.rebalance_on_return,
    )
    proxy = ProxyProcess(proxy_cfg).start()
    parts = Parts(run_dir, proxy, await ProxyAdmin(proxy.url, proxy.admin_token).__aenter__(), launcher)
    try:
        await _start_cells(cfg, parts, resume)
        await _register_engines(parts)
        _join_training(parts)
    except BaseException:
        await close(parts)
        raise
    return parts


async def _start_cells(cfg: GyreConfig, parts: Parts, resume: bool) -> None:
    n = cfg.cluster.num_cells
    parts.policy = RolloutOnlyPolicy(cfg.scheduler, n) if cfg.mode == "rollout" else make_policy(cfg.scheduler, n)
    parts.decode = DecodeMeter(cfg.coordinator.decode_window_s)
    roles = parts.policy.initial_roles()
    k = cfg.cluster
    parts.listener = listen(
        k.control,
        parts.launcher.host,
        port_file=str(RunPaths(parts.run_dir).control_port(os.getpid())),
        peer_timeout_s=k.control_peer_timeout_s,
    )
    address = parts.listener.address
    for state, role in zip(make_cells(n, cfg.cluster.cell_nodes), roles):
        state.role = _start_role(role, state.is_core)
        spec = CellSpec(
            index=state.index,
            role=state.role.value,
            model=cfg.model,
            trainer=cfg.trainer,
            engine=cfg.engine,
            seed=cfg.seed,
            ranks=cfg.cluster.ranks_per_cell,
            nodes=cfg.cluster.cell_nodes,
            host=parts.launcher.host,
            coordinator_address=address,
            control=k.control,
            control_peer_timeout_s=k.control_peer_timeout_s,
            proxy_url=parts.proxy.url,
            proxy_admin_token=parts.proxy.admin_token,
            checkpoint_dir=str(RunPaths(parts.run_dir).checkpoints),
            run_dir=str(parts.run_dir),
            init_weights=cfg.coordinator.init_weights,
            resume=resume,
        )
        cell = parts.launcher.make_cell(spec, state)
        parts.cells.append(cell)
        cell.start()
    await asyncio.to_thread(_accept_cells, parts, cfg.coordinator.cell_start_timeout_s)


def _accept_cells(parts: Parts, timeout_s: float) -> None:
    """Accept every leader's connection and its CellReady (leaders build trainer + engine meanwhile)."""
    ready: set[int] = set()

    def all_ready() -> bool:
        for c in parts.cells:
            c.check_alive()
        if (cell := _accept_one(parts, timeout_s)) is not None:
            ready.add(cell)
        return len(ready) == len(parts.cells)

    if not wait_until(all_ready, timeout_s, interval_s=0):  # each look waits up to a second in accept
        pending = len(parts.cells) - len(ready)
        raise CellError(f"{pending} cell leader(s) not ready after {timeout_s} s (coordinator.cell_start_timeout_s)")


def _accept_one(parts: Parts, timeout_s: float) -> int | None:
    """One leader's connection and CellReady: its cell (None: no leader connected within a second,
    or its channel closed before its CellReady).

    Raises:
        CellError: the leader said something else first.
    """
    try:
        channel = parts.listener.accept(timeout_s=1.0)
    except ChannelTimeout:
        return None
    try:
        ready = channel.recv(timeout_s=timeout_s)
    except ChannelClosed as e:  # a handshake its leader gave up on (MPI: it connects again)
        log.warning("a leader's channel closed before its CellReady (%s); waiting for the others", e)
        channel.close()
        return None
    if not isinstance(ready, CellReady):
        raise CellError(f"a cell leader said {type(ready).__name__} before CellReady")
    parts.cells[ready.cell].ready(channel, ready.engine_urls)
    if ready.cell == 0:
        parts.core_address, parts.initial = ready.core_address, ready
    return ready.cell


async def _register_engines(parts: Parts) -> None:
    """Every engine of every cell in the proxy, under its cell (serving ones active, the others
    closed), at the core's weights."""
    for cell in parts.cells:
        for eid, engine in zip(cell.engine_ids, cell.engines, strict=True):
            await parts.admin.add_engine(eid, engine.url, str(cell.index))
            await serve_weights(engine, eid, parts.admin, parts.initial.weights)
            if cell.state.role != Role.ROLLOUT:
                await parts.admin.engine_op(eid, "stop_admission")
                async with engine.client() as client:
                    await engine.release(client)


def _start_role(role: Role, is_core: bool) -> Role:
    """The role a cell's leader starts in: a satellite the policy wants training starts serving
    (see `_join_training`)."""
    return Role.ROLLOUT if role == Role.TRAIN and not is_core else role


def _join_training(parts: Parts) -> None:
    """Satellites the policy starts in training (async's training pool) switch at once: a
    satellite trains only once it has pulled the core's weights and joined its step, which only
    the switch does."""
    for cell, role in zip(parts.cells, parts.policy.initial_roles()):
        if role != cell.state.role:
            cell.begin_switch(role, time.time(), parts.initial.weights, parts.core_address)


async def close(parts: Parts) -> None:
    """Stop everything `build` started (idempotent)."""
    await asyncio.gather(*(asyncio.to_thread(cell.stop) for cell in parts.cells))  # leaders stop side by side
    if parts.listener is not None:
        parts.listener.close()
    await parts.admin.__aexit__(None, None, None)
    parts.proxy.stop()
