"""Slurm cells: each cell leader runs in a task of the run's heterogeneous job, component k+1 for cell k.

    gyre-train ─submitit─> het job, one step over every component (gyre.launch.job)
      component 0, rank 0: coordinator ─ listener on its node ─ writes CellSpec k  ─┐
      component k+1, rank 0: waits for its CellSpec ─ binds its own node ─ writes the group's rendezvous
                             ─ CellLeader (trainer rank 0) ─connect─> CellReady
      component k+1, ranks > 0 (cell_nodes x ranks_per_node tasks in all, srun-placed): wait for the
                             spec and the rendezvous ─ bind their own node ─ a node's first rank starts
                             its node's engines ─ follow rank 0 (gyre.train.ranks.follow), each linked
                             to it: either one's death ends the cell, and so does an engine's exit

The leaders are started by Slurm together with the coordinator, so `SlurmCell.start` hands a
leader its spec through the job directory (shared file system, like submitit's own pickles): the
spec carries the listener's address and key, so the file is private to the user. Spec and status
files are named by the job's restart count, so a requeued job's tasks never read the previous
run's. A rank that fails leaves its traceback in a `.failed` file, which `check_alive` reports (any
rank lost is the cell's loss); a follower that ends leaves `cell<k>.r<restart>.rank<r>.json`.
"""

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import threading
import traceback
from pathlib import Path

from gyre.cells.base import BaseCell, CellError, leader_command
from gyre.cells.placement import SlurmPlacement
from gyre.cells.serving import joined_by, plan_cell, plan_engines, started_by
from gyre.cells.spec import CellSpec
from gyre.common import jsonio
from gyre.common.files import write_private_file
from gyre.common.ports import PortReservation
from gyre.common.serve import exit_at_once, first_exited
from gyre.common.wait import wait_until
from gyre.scheduler.cells import Cell

log = logging.getLogger(__name__)


def spec_path(job_dir: Path, cell: int, restart: int) -> Path:
    return job_dir / f"cell{cell}.r{restart}.json"


def failed_path(job_dir: Path, cell: int, restart: int, rank: int = 0) -> Path:
    return job_dir / (f"cell{cell}.r{restart}.failed" if rank == 0 else f"cell{cell}.r{restart}.rank{rank}.failed")


def group_path(job_dir: Path, cell: int, restart: int) -> Path:
    """The cell's torch.distributed rendezvous (MASTER_ADDR/PORT, WORLD_SIZE), written by its rank 0."""
    return job_dir / f"cell{cell}.r{restart}.group.json"


def rank_path(job_dir: Path, cell: int, restart: int, rank: int) -> Path:
    """What a follower rank did (node, operations run), written when it ends."""
    return job_dir / f"cell{cell}.r{restart}.rank{rank}.json"


def engine_path(job_dir: Path, cell: int, restart: int, index: int) -> Path:
    """Where engine `index`, spanning nodes, publishes its node rank 0's rendezvous (--dist-init-addr)."""
    return job_dir / f"cell{cell}.r{restart}.engine{index}.json"


def coordinator_exit_path(job_dir: Path, restart: int) -> Path:
    """Written when the coordinator's task ends: leaders still waiting for a spec stop waiting."""
    return job_dir / f"coordinator.r{restart}.exit"


def node_address(placement: SlurmPlacement, bind_host: str | None) -> str:
    """The address this task's servers bind and advertise: `bind_host`, else its node's name resolved."""
    return bind_host or socket.gethostbyname(placement.node or socket.gethostname())


class SlurmCell(BaseCell):
    """One cell whose leader is the first task of het component `index + 1` of this job."""

    def __init__(self, spec: CellSpec, state: Cell, job_dir: Path, restart: int):
        super().__init__(spec, state)
        self.job_dir, self.restart = job_dir, restart

    def start(self) -> None:
        write_private_file(spec_path(self.job_dir, self.index, self.restart), self.spec.to_json())

    def check_alive(self) -> None:
        for failed in sorted(self.job_dir.glob(f"cell{self.index}.r{self.restart}.*failed")):
            raise CellError(
                f"cell {self.index}'s {failed.name} (Slurm component {self.index + 1}):\n"
                f"{failed.read_text(errors='replace')[-3000:]}"
            )

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.channel is not None:
            self.channel.close()  # the leader sees EOF, stops its engine, its task returns


class SlurmLauncher:
    """Makes the cells of the het job this coordinator runs in (component 0)."""

    def __init__(self, job_dir: Path, placement: SlurmPlacement, bind_host: str | None):
        self.job_dir, self.placement = job_dir, placement
        self.host = node_address(placement, bind_host)

    def proxy_host(self, configured: str) -> str:
        """The proxy binds this node's address: leaders on other nodes call its admin API."""
        return self.host

    def make_cell(self, spec: CellSpec, state: Cell) -> SlurmCell:
        if state.index + 1 >= self.placement.het_size:
            raise CellError(
                f"cell {state.index} has no component: the job has {self.placement.het_size} "
                "(cluster.num_cells changed after submission?)"
            )
        spec = dataclasses.replace(spec, followers_placed=True)  # srun runs a task per rank
        return SlurmCell(spec, state, self.job_dir, self.placement.restart_count)

    def describe(self) -> dict:
        """How cells were placed, for the run's summary."""
        return {"mechanism": "slurm", "job_id": self.placement.job_id, "restart_count": self.placement.restart_count}


def run_cell_task(job_dir: Path, placement: SlurmPlacement, bind_host: str | None, timeout_s: float) -> None:
    """A task of a cell's component: its first runs the cell's leader once the coordinator wrote
    its spec, the others follow it as ranks 1.. of the cell's trainer.

    Raises:
        CellError: no spec (or rendezvous) within `timeout_s` (the coordinator failed first, or never
            started), or a component whose tasks are not the spec's ranks.
    """
    # Slurm signals every process of the step (scancel -s USR2, --signal before the time limit):
    # only the coordinator acts on it; the leader and its engine ignore it, children inherit that.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    cell, restart, rank = placement.het_group - 1, placement.restart_count, placement.group_rank
    try:
        spec = CellSpec.from_json(_wait_for("spec", spec_path(job_dir, cell, restart), job_dir, restart, timeout_s))
        if spec.ranks != placement.group_tasks:
            raise CellError(
                f"cell {cell}: its component runs {placement.group_tasks} tasks, its spec has {spec.ranks} ranks "
                "(cluster.cell_nodes or cluster.ranks_per_node changed after submission?)"
            )
        _export_rank_place(spec, placement)
        host = node_address(placement, bind_host)  # this task's node: every rank binds its own
        if rank > 0:
            _follow(job_dir, placement, spec, host, timeout_s)
            return
        # the leader starts its node's engines from one config (the first's): advertised at its node's
        # address, which the proxy dials (engine.bind_host stays as set), with a spanning server's rendezvous
        with contextlib.ExitStack() as held:  # a spanning server's rendezvous port, as long as the leader runs
            ((engine, _), *_) = _node_engines(job_dir, restart, spec, 0, host, timeout_s, held)
            _run_leader(job_dir, placement, dataclasses.replace(spec, host=host, engine=engine))
    except BaseException:
        write_private_file(
            failed_path(job_dir, cell, restart, rank),
            f"rank {rank} on node {placement.node}:\n{traceback.format_exc()}",
        )
        raise


def _export_rank_place(spec: CellSpec, placement: SlurmPlacement) -> None:
    """Export this rank's planned LOCAL_RANK (its CUDA device: gyre.train.model), after checking
    that srun put the task where the plan has it (block distribution: SLURM_LOCALID = local rank).

    Raises:
        CellError: srun placed the task elsewhere (a cyclic or arbitrary distribution).
    """
    layout = plan_cell(spec.ranks, spec.nodes, 0, spec.engine.tp_size, spec.engine.on_gpu, nnodes=spec.engine.nnodes)
    slot = layout.ranks[placement.group_rank]
    if slot.local_rank != placement.local_id:
        raise CellError(
            f"cell {spec.index}: rank {slot.rank} runs as task {placement.local_id} of its node (SLURM_LOCALID), "
            f"the plan has it as task {slot.local_rank} of node {slot.node}: the step must place tasks in blocks "
            "(srun --distribution=block, Slurm's default)"
        )
    os.environ.update(slot.exports())


def _run_leader(job_dir: Path, placement: SlurmPlacement, spec: CellSpec) -> None:
    cell, restart = spec.index, placement.restart_count
    Path(spec.run_dir).mkdir(parents=True, exist_ok=True)
    log.warning(
        "cell %d: leader on %s (%s), restart %d, control %s, %d ranks",
        cell,
        placement.node,
        spec.host,
        restart,
        spec.control,
        spec.ranks,
    )
    # rank 0 of the cell's group (its followers are this component's other tasks) binds the group's
    # store in the leader's Trainer: its port stays reserved as long as the leader runs
    with PortReservation() if spec.ranks > 1 else contextlib.nullcontext() as master_port:
        if spec.ranks > 1:
            group = {"WORLD_SIZE": str(spec.ranks), "MASTER_ADDR": spec.host, "MASTER_PORT": str(master_port)}
            os.environ.update(group | {"RANK": "0"})  # the leader (or mpiexec's child) inherits them
            write_private_file(group_path(job_dir, cell, restart), jsonio.dumps(group))
        if spec.control == "mpi":  # an MPI process of its own, under mpiexec on this node
            rc = subprocess.run(leader_command(spec_path(job_dir, cell, restart), spec.control)).returncode
            if rc != 0:
                raise CellError(f"cell {cell}: its leader under mpiexec exited with code {rc}")
            return
        from gyre.cells.leader import CellLeader

        CellLeader(spec).run()


def _follow(job_dir: Path, placement: SlurmPlacement, spec: CellSpec, host: str, timeout_s: float) -> None:
    """Rank `group_rank` of the cell: join rank 0's group and run what it announces until it stops;
    its Mooncake endpoint binds `host`, its own node's address (rank 0 may be on another node)."""
    from gyre.train.ranks import run_follower

    cell, restart, rank = spec.index, placement.restart_count, placement.group_rank
    group = jsonio.loads(_wait_for("rendezvous", group_path(job_dir, cell, restart), job_dir, restart, timeout_s))
    os.environ.update(group | {"RANK": str(rank)})
    log.warning("cell %d: rank %d of %d on %s (%s), restart %d", cell, rank, spec.ranks, placement.node, host, restart)
    with contextlib.ExitStack() as held:  # a spanning server's rendezvous port, until its engine started
        engines = _start_node_engines(_node_engines(job_dir, restart, spec, rank, host, timeout_s, held), spec)
    stopping, failed = threading.Event(), failed_path(job_dir, cell, restart, rank)
    threading.Thread(target=_exit_with_engines, args=(engines, stopping, failed), daemon=True).start()
    urls = [engine.url for engine in engines if engine.url]  # node rank 0's: a server registers once
    try:
        done = run_follower(spec.model, spec.trainer, spec.seed, host, urls)
        record = {"rank": rank, "num_ranks": spec.ranks, "node": placement.node, "host": host, "engine_urls": urls}
        record |= {"ops": dict(done), "num_ops": sum(done.values())}
        write_private_file(rank_path(job_dir, cell, restart, rank), jsonio.dumps(record))
    finally:  # after the record: the run may be checked as soon as rank 0 is done
        stopping.set()
        for engine in engines:
            engine.stop()


def _node_engines(
    job_dir: Path, restart: int, spec: CellSpec, rank: int, host: str, timeout_s: float, held: contextlib.ExitStack
) -> list:
    """The (config, base GPU) of each engine server process this rank starts on its node, if it is
    the node's first rank (gyre.cells.serving `started_by`, `joined_by`): advertised at `host`, its
    node's address, with its node rank; for a server spanning nodes, node rank 0's starter picks the
    rendezvous and publishes it in the job directory, the other nodes' wait for it. The rendezvous
    port stays reserved until `held` closes (after the engine started: SGLang binds it by number)."""
    engine = spec.engine
    slots = plan_engines(spec.ranks, spec.nodes, engine.tp_size, engine.on_gpu, engine.nnodes)
    out = []
    for slot in started_by(slots, rank):
        cfg = dataclasses.replace(engine, host=host, nnodes=slot.nnodes)
        if slot.nnodes > 1:
            cfg = dataclasses.replace(cfg, dist_init_addr=f"{host}:{held.enter_context(PortReservation())}")
            rendezvous = jsonio.dumps({"dist_init_addr": cfg.dist_init_addr})
            write_private_file(engine_path(job_dir, spec.index, restart, slot.index), rendezvous)
        out.append((cfg, slot.base_gpu_id))
    for slot, node_rank in joined_by(slots, rank):
        path = engine_path(job_dir, spec.index, restart, slot.index)
        addr = jsonio.loads(_wait_for("engine rendezvous", path, job_dir, restart, timeout_s))["dist_init_addr"]
        cfg = dataclasses.replace(engine, host=host, nnodes=slot.nnodes, node_rank=node_rank, dist_init_addr=addr)
        out.append((cfg, slot.base_gpu_id))
    return out


def _start_node_engines(configs: list, spec: CellSpec) -> list:
    """Start this rank's engine processes (`_node_engines`) from this thread, as they die with the
    thread that spawned them."""
    from gyre.engines.launch import make_engine_process

    engines = [make_engine_process(cfg, spec.model, base_gpu_id) for cfg, base_gpu_id in configs]
    for engine in engines:
        engine.start()
    return engines


def _exit_with_engines(engines: list, stopping: threading.Event, failed: Path) -> None:
    """An engine of this node that exits takes this rank with it, and so the cell (rank 0 sees the
    rank's link close; `check_alive` reads why in its `.failed` file), as a rank's death does."""
    engine = first_exited(engines, stopping)
    if engine is not None:
        code, name = engine.proc.returncode, engine.url or f"node rank {engine.cfg.node_rank} of a server"
        write_private_file(failed, f"{name} exited with code {code}; log tail:\n{engine.log_tail()}")
        log.error("%s, this node's engine, exited with code %s: this rank exits", name, code)
        for each in engines:  # they die after us (PR_SET_PDEATHSIG), unstopped
            each.remove_files()
        exit_at_once(1)


def _wait_for(what: str, path: Path, job_dir: Path, restart: int, timeout_s: float) -> str:
    """The text of `path` once it exists (written atomically by the coordinator or the cell's rank 0)."""

    def written() -> bool:
        if coordinator_exit_path(job_dir, restart).exists():
            raise CellError(f"{path.name}: the coordinator ended before it started this cell")
        return path.exists()

    if not wait_until(written, timeout_s, interval_s=0.2):
        raise CellError(f"no {what} at {path} after {timeout_s} s (coordinator.cell_start_timeout_s)")
    return path.read_text()
