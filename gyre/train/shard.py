"""Each rank's part of elastic training: its Mooncake endpoint, its weight shard and gradient slots,
and the operations rank 0 announces for them (gyre/train/ranks.py `RANK_OPS`).

    core rank r                                          satellite rank r (same layout, same r)
    weights shard [N_r], registered  <── Mooncake read ──  core_pull: its shard, all ranks at once
    slots [K, N_r], registered       <── Mooncake write ─  satellite_compute: its gradient shard
    core_fold: slot of micro-step i ──broadcast from its data-parallel owner──> acc += it (index order)
               (the other replicas receive it in `trainer.grad`: their own slots stay untouched)

Rank r of a satellite talks to rank r of the core only: both cells have the same tensor- and
data-parallel layout, so their shards have the same shape. A micro-step is computed by one
data-parallel replica (its tensor-parallel ranks together); each of those ranks writes its gradient
shard to the same core rank, so micro-step i's gradient sits on the core's ranks of that replica
(its *owner*), in a row of their slots: each replica's K rows are its own (gyre.train.core_state),
so K x DP micro-steps can be in flight at K rows a rank. Folding broadcasts it from the owner
over the core's data-parallel group and every rank adds it in index order: the sum is bit for bit
the one `Trainer.fold` makes alone.
"""

import hashlib
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gyre.train.trainer import Trainer
from gyre.transfer import TransferEndpoint


@dataclass
class RankState:
    """What one rank of a cell holds besides its trainer (filled in by the ops below)."""

    trainer: Trainer
    host: str | None = None
    """This rank's own address for its Mooncake endpoint (a follower on a node of its own, placed by
    Slurm); None: the address rank 0 announces with the op (a follower on rank 0's machine)."""
    endpoint: TransferEndpoint | None = None
    slots: torch.Tensor | None = None
    """[K, N_r] the core's gradient slots on this rank."""
    acc: torch.Tensor | None = None
    """[N_r] the core's sum of the open step's folded micro-steps on this rank."""
    peer: tuple[str, int, int] | None = None
    """A satellite rank's core peer: (Mooncake session, weights address, slots address)."""
    link: socket.socket | None = None
    """A follower's TCP link to rank 0 (gyre/train/ranks.py `_link`), open while this process lives."""
    engine_urls: list[str] = field(default_factory=list)
    """The engines this rank started (on Slurm, a node's first rank starts its node's: gyre.cells.serving)."""
    opened: bool = False
    """A satellite rank whose weights and gradient are registered with its endpoint (`satellite_open`)."""


def _dp() -> tuple[int, int, object]:
    """(data-parallel size, this rank's data-parallel index, the group or None with one replica)."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    return dp, parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_group() if dp > 1 else None


def _gather(item) -> list:
    """`item` of every rank of the cell, by global rank (a one-rank cell: no collective)."""
    if dist.get_world_size() == 1:
        return [item]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, item)
    return out


def _endpoint(state: RankState, host: str) -> TransferEndpoint:
    """This rank's endpoint, bound to its own node's address (`state.host`), else to rank 0's `host`."""
    if state.endpoint is None:
        state.endpoint = TransferEndpoint(state.host or host)
    return state.endpoint


def _compute(state: RankState, jobs: list, keep) -> dict[int, tuple]:
    """Replica d runs jobs[d] = (batch, slot) if it has one, then `keep(grad, slot)`; returns
    {d: (stats, seconds, unix time it ended, global rank)} per job, once every rank is through."""
    _, me, _ = _dp()
    mine = None
    if me < len(jobs) and jobs[me] is not None:
        t0 = time.perf_counter()
        grad, stats = state.trainer.microstep(jobs[me][0])
        keep(grad, jobs[me][1])
        mine = (me, stats, time.perf_counter() - t0, time.time(), dist.get_rank())
    return _per_replica(_gather(mine))


def _per_replica(results: list) -> dict[int, tuple]:
    """{replica: (stats, seconds, ended, rank)} from every rank's (replica, stats, seconds, ended,
    rank) or None (its tensor-parallel ranks computed the job together: the first one speaks)."""
    first: dict[int, tuple] = {}
    for item in results:
        if item is not None:
            first.setdefault(item[0], item[1:])
    return first


def weights_digest(state: RankState) -> str:
    """A digest of the cell's whole model: one rank's weights under data parallel (every replica
    holds the same, so any layout of one tensor-parallel size digests alike), else a digest of the
    first replica's tensor-parallel shards in order."""
    from megatron.core import parallel_state

    mine = hashlib.sha256(state.trainer.flat.weights.detach().cpu().numpy().tobytes()).hexdigest()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return mine[:16]
    key = (_dp()[1], parallel_state.get_tensor_model_parallel_rank())
    shards = sorted(item for item in _gather((key, mine)) if item[0][0] == 0)
    return hashlib.sha256("".join(d for _, d in shards).encode()).hexdigest()[:16]


# ---- the core's ranks ---------------------------------------------------------------------------
def core_open(state: RankState, host: str, num_slots: int) -> list[tuple[str, int, int]]:
    """Register this rank's weight shard and K gradient slots. Returns every rank's (Mooncake
    session, weights address, slots address), by global rank."""
    endpoint = _endpoint(state, host)
    weights = state.trainer.flat.weights
    state.slots = torch.zeros(num_slots, weights.numel(), dtype=torch.float32, device=weights.device)
    state.acc = torch.zeros_like(weights)
    return _gather((endpoint.session_id, endpoint.register(weights), endpoint.register(state.slots)))


def core_close(state: RankState) -> None:
    state.endpoint.unregister(state.slots)
    state.endpoint.unregister(state.trainer.flat.weights)


def core_compute(state: RankState, jobs: list) -> dict[int, tuple]:
    """Replica d computes jobs[d] = (batch, slot row), if it has one, into that row of its slots
    (row None: leave it in `trainer.grad` for the fold that follows). Returns {d: (stats, seconds,
    ended, rank)}."""

    def keep(grad: torch.Tensor, slot: int | None) -> None:
        if slot is not None:
            state.slots[slot].copy_(grad)

    return _compute(state, jobs, keep)


def core_fold(state: RankState, entries: list[tuple[int | None, int]]) -> None:
    """Add micro-steps to the step's sum in the order given: (slot row, owner replica) each, row
    None being the gradient the owner just computed (`core_compute` with no slot; first if at all,
    as the other ranks receive into that same scratch buffer, `trainer.grad`)."""
    dp, me, group = _dp()
    for slot, owner in entries:
        grad = state.trainer.grad if slot is None or owner != me else state.slots[slot]
        if dp > 1:
            dist.broadcast(grad, src=dist.get_global_rank(group, owner), group=group)
        state.acc.add_(grad)


def core_apply(state: RankState, normaliser: float) -> dict:
    """One optimizer step with the folded sum (then zeroed for the next step)."""
    metrics = state.trainer.apply_gradient(state.acc, normaliser)
    state.acc.zero_()
    return metrics


def core_reset(state: RankState) -> None:
    """Drop a partial sum (an aborted step)."""
    state.acc.zero_()


def skip_step(state: RankState) -> None:
    state.trainer.skip_step()


# ---- a satellite's ranks ------------------------------------------------------------------------
def satellite_open(state: RankState, host: str) -> None:
    """Register this rank's weights (pulled into) and gradient (written from)."""
    endpoint = _endpoint(state, host)
    endpoint.register(state.trainer.flat.weights)
    endpoint.register(state.trainer.grad)
    state.opened = True


def offload_trainer(state: RankState) -> None:
    """The cell serves now: this rank's trainer state leaves the device (gyre.train.trainer.Trainer.offload);
    its Mooncake registrations go first, as the memory under them goes away."""
    if state.opened and not state.trainer.offloaded:
        state.endpoint.unregister(state.trainer.grad)
        state.endpoint.unregister(state.trainer.flat.weights)
    state.trainer.offload()


def onload_trainer(state: RankState) -> None:
    """The cell trains again: the state comes back, registered at its new addresses."""
    if not state.trainer.offloaded:
        return
    state.trainer.onload()
    if state.opened:
        state.endpoint.register(state.trainer.flat.weights)
        state.endpoint.register(state.trainer.grad)


def satellite_peer(state: RankState, peers: list[tuple[str, int, int]]) -> None:
    """Remember this rank's core peer: the core rank of the same global rank."""
    state.peer = tuple(peers[dist.get_rank()])


def satellite_pull(state: RankState) -> list[float]:
    """Read this rank's weight shard from its core peer, every rank at once. Returns each rank's
    seconds, by rank (the pull is over once every shard is in: the slowest rank's)."""
    t0 = time.perf_counter()
    session, weights_addr, _ = state.peer
    state.endpoint.read(session, weights_addr, state.trainer.flat.weights)
    return _gather(time.perf_counter() - t0)


def satellite_compute(state: RankState, jobs: list) -> dict[int, tuple]:
    """Replica d computes jobs[d] = (batch, slot row) and each of its ranks writes its gradient
    shard into that row of its core peer's slots (its replica's). Returns {d: (stats, seconds,
    ended, rank)} once every rank's write is over."""
    session, _, slots_addr = state.peer

    def write(grad: torch.Tensor, slot: int) -> None:
        state.endpoint.write(session, slots_addr + slot * grad.numel() * grad.element_size(), grad)

    return _compute(state, jobs, write)


def satellite_close(state: RankState) -> None:
    if not state.trainer.offloaded:
        state.endpoint.unregister(state.trainer.grad)
        state.endpoint.unregister(state.trainer.flat.weights)
    state.opened = False


SHARD_OPS = frozenset(
    {
        core_open,
        core_close,
        core_compute,
        core_fold,
        core_apply,
        core_reset,
        skip_step,
        satellite_open,
        satellite_peer,
        satellite_pull,
        satellite_compute,
        satellite_close,
        offload_trainer,
        onload_trainer,
        weights_digest,
    }
)
"""The rank operations of this module (gyre/train/ranks.py RANK_OPS)."""
