"""Which engines serve a cell, and each rank's share of a role switch's phases (pure).

A cell of `ranks` trainer ranks on `nodes` nodes (ranks block-placed: node n holds ranks
n*per_node .. (n+1)*per_node - 1) serves through one engine per

    CPU (the builtin engine, SGLang's contract fake): node, serving that node's ranks
    GPU (SGLang):                                      engine.tp_size ranks of one node (their GPUs),
                                                       or of engine.nnodes whole nodes (a TP group
                                                       wider than a node: one server process per node)

Locally a cell's ranks share one machine, and `cluster.cell_nodes` > 1 emulates nodes: the ranks
split into cell_nodes groups of consecutive ranks with one engine each, as on Slurm. Every engine
registers with the proxy under its cell's index, so the scheduler still sees one cell whose
sessions and decode capacity are its engines' summed (gyre.scheduler.decode.measure_cells). On
Slurm each node's first rank starts that node's engines, bound to its node's address (`started_by`:
rank 0, the leader, its own node's; a follower, the others'), and the leader drives them all through
their HTTP APIs as it drives its own. An engine spanning nodes runs one SGLang process on each of
its nodes with its node rank (`joined_by`: the node's first rank starts node ranks >= 1); only node
rank 0's serves HTTP, so the engine has one URL and registers once with the proxy.

A switch's phase is over when every rank has done its part of it. Rank r's phase time is the time
from the phase's start until r's part was done: its engine's operation (engine phases), its own
weight shard's read (pull_weights), or the whole phase (join_step, finish_microstep: all ranks in
lockstep). The cell's phase time is its slowest rank's.

On a GPU cluster (`cluster.gpus_per_node` > 0) `plan_cell` lays the whole cell out before anything
starts: one trainer rank per GPU (rank r of a node on GPU r, CUDA device = its local rank, which
Slurm gives as SLURM_LOCALID), and each GPU also belongs to exactly one engine (engine.tp_size GPUs
of one node); the trainer and the engine take turns on it as the cell's role changes. A layout that
leaves a GPU idle, or puts two ranks or two engines on one, is refused naming the key. Every task
of a node sees all of the node's GPUs (the job asks `--gpus-per-node`, no per-task binding), so a
rank exports only LOCAL_RANK and an engine takes `--base-gpu-id` (torchtitan plans its mesh the
same way up front: torchtitan/distributed/parallel_dims.py).
"""

from collections.abc import Sequence
from dataclasses import dataclass

from gyre.errors import require


@dataclass(frozen=True)
class EngineSlot:
    """One engine of a cell: where it runs and which trainer ranks' devices it serves from."""

    index: int
    """Its place among the cell's engines (0 is started by the leader's own node)."""
    node: int
    """The cell's node it runs on."""
    ranks: tuple[int, ...]
    base_gpu_id: int
    """Its first GPU on each of its nodes (SGLang's --base-gpu-id); 0 on CPU."""
    nnodes: int = 1
    """Nodes it spans (engine.nnodes): `node` (node rank 0, which serves HTTP) .. node + nnodes - 1."""

    def node_ranks(self, node_rank: int) -> tuple[int, ...]:
        """The cell's ranks whose GPUs its process of node rank `node_rank` serves from."""
        share = len(self.ranks) // self.nnodes
        return self.ranks[node_rank * share : (node_rank + 1) * share]


def plan_engines(ranks: int, nodes: int, tp_size: int, on_gpu: bool, nnodes: int | None = None) -> list[EngineSlot]:
    """The engines of a cell of `ranks` ranks on `nodes` nodes (see the module doc).

    Args:
        nnodes: engine.nnodes; None: the nodes that tp_size GPUs fill (1 when they fit on one node).
    Raises:
        ConfigError: naming `cluster.cell_nodes` when the ranks do not split evenly over the nodes,
            `engine.tp_size` when a node's ranks do not split into engines of tp_size GPUs, or
            `engine.nnodes` when an engine spanning nodes would not take whole nodes.
    """
    require(
        ranks % nodes == 0,
        "cluster.cell_nodes",
        f"{nodes} nodes per cell do not split its {ranks} ranks evenly (locally a cell emulates "
        "cell_nodes nodes, one engine each: set cluster.ranks_per_cell to a multiple of cell_nodes)",
    )
    per_node = ranks // nodes
    span = _engine_nodes(per_node, nodes, tp_size, on_gpu, nnodes)
    width = tp_size // span if on_gpu and (per_node > 1 or span > 1) else per_node
    require(
        per_node % width == 0,
        "engine.tp_size",
        f"{tp_size} GPUs per engine do not divide the {per_node} ranks (GPUs) of a node of the cell; "
        "an engine serves tp_size ranks of one node (or of engine.nnodes whole nodes)",
    )
    slots = []
    for first_node in range(0, nodes, span):
        for k in range(per_node // width):
            spanned = range(first_node, first_node + span)
            own = tuple(
                r for node in spanned for r in range(node * per_node + k * width, node * per_node + (k + 1) * width)
            )
            slots.append(EngineSlot(len(slots), first_node, own, k * width if on_gpu else 0, span))
    return slots


def _engine_nodes(per_node: int, nodes: int, tp_size: int, on_gpu: bool, nnodes: int | None) -> int:
    """How many nodes one engine spans: whole nodes of tp_size / nnodes GPUs each, tiling the cell's
    (a refusal names engine.nnodes when it was set, else engine.tp_size, whose width it follows)."""
    if not on_gpu:
        require(nnodes in (None, 1), "engine.nnodes", "only SGLang on GPUs spans nodes (a CPU engine serves one node)")
        return 1
    span = nnodes or (tp_size // per_node if 1 < per_node < tp_size else 1)  # one rank a node: one engine each
    key = "engine.nnodes" if nnodes else "engine.tp_size"
    if span > 1:
        require(
            tp_size == span * per_node,
            key,
            f"an engine on {span} nodes takes all {per_node} GPUs of each: engine.tp_size must be "
            f"{span * per_node}, got {tp_size}",
        )
        require(
            nodes % span == 0, key, f"engines of {span} nodes do not tile the cell's {nodes} nodes (cluster.cell_nodes)"
        )
    return span


@dataclass(frozen=True)
class RankSlot:
    """One trainer rank of a cell: where it runs and the GPU it shares with its engine."""

    rank: int
    node: int
    local_rank: int
    """Its place among its node's ranks (Slurm's SLURM_LOCALID under block distribution)."""
    device: int | None
    """Its CUDA device on its node (= local_rank); None where the cluster declares no GPUs."""
    engine: int
    """The index of the engine whose GPUs include this rank's (the two take turns on it)."""
    tp_rank: int = 0
    """Its place in its tensor-parallel group (megatron-core's order: TP groups are consecutive ranks)."""
    dp_rank: int = 0
    """Its data-parallel replica."""

    def exports(self) -> dict[str, str]:
        """What the rank's process exports before torch.distributed starts (gyre.train.model reads it)."""
        return {"LOCAL_RANK": str(self.local_rank)}


@dataclass(frozen=True)
class CellLayout:
    """Where every rank and engine of a cell runs (the same in every cell)."""

    ranks: tuple[RankSlot, ...]
    engines: tuple[EngineSlot, ...]

    def node_devices(self, node: int = 0) -> list[int | None]:
        """The CUDA devices of `node`'s ranks, in rank order."""
        return [r.device for r in self.ranks if r.node == node]


def plan_cell(
    ranks: int,
    nodes: int,
    gpus_per_node: int,
    tp_size: int,
    on_gpu: bool,
    trainer_tp: int = 1,
    nnodes: int | None = None,
) -> CellLayout:
    """Every rank's node, local rank, device and TP/DP place, and the cell's engines (see the module doc).

    Args:
        gpus_per_node: the cluster's (0: no GPUs declared; only the engines are planned, as before).
        tp_size: GPUs of one engine (engine.tp_size).
        on_gpu: engines serve from GPUs (SGLang), one per tp_size GPUs of a node.
        trainer_tp: trainer.tensor_parallel_size; the cell's other ranks are data parallel.
        nnodes: engine.nnodes (None: what tp_size fills).
    Raises:
        ConfigError: naming `cluster.ranks_per_node` when a node's ranks are not one per GPU,
            `engine.tp_size` when engines do not tile a node's GPUs, `trainer.tensor_parallel_size`
            when a TP group would not be GPUs of one node, or what `plan_engines` names.
    """
    engines = plan_engines(ranks, nodes, tp_size, on_gpu, nnodes)
    per_node = ranks // nodes
    if gpus_per_node:
        require(
            per_node == gpus_per_node,
            "cluster.ranks_per_node",
            f"{per_node} trainer ranks on a node of {gpus_per_node} GPUs (cluster.gpus_per_node): "
            + ("GPUs would stay idle" if per_node < gpus_per_node else "two ranks would share a GPU")
            + "; one rank per GPU (leave cluster.ranks_per_node unset)",
        )
        require(
            not on_gpu or gpus_per_node % (tp_size // engines[0].nnodes) == 0,
            "engine.tp_size",
            f"engines of {tp_size} GPUs do not tile a node's {gpus_per_node} GPUs (an engine spans one "
            "node, or engine.nnodes whole nodes)",
        )
        require(
            gpus_per_node % trainer_tp == 0,
            "trainer.tensor_parallel_size",
            f"TP groups of {trainer_tp} ranks do not tile a node's {gpus_per_node} GPUs (a TP group stays "
            "on one node's NVLink)",
        )
    engine_of = {r: slot.index for slot in engines for r in slot.ranks}
    slots = tuple(
        RankSlot(
            r,
            r // per_node,
            r % per_node,
            r % per_node if gpus_per_node else None,
            engine_of[r],
            tp_rank=r % trainer_tp,
            dp_rank=r // trainer_tp,
        )
        for r in range(ranks)
    )
    return CellLayout(slots, tuple(engines))


def started_by(slots: Sequence[EngineSlot], rank: int) -> list[EngineSlot]:
    """The engines rank `rank` starts on Slurm: its node's, if it is that node's first rank (a
    process's children run on its own node)."""
    first_rank = {}
    for slot in slots:
        first_rank.setdefault(slot.node, slot.ranks[0])
    return [slot for slot in slots if first_rank[slot.node] == rank]


def joined_by(slots: Sequence[EngineSlot], rank: int) -> list[tuple[EngineSlot, int]]:
    """The (engine, node rank >= 1) server processes rank `rank` starts on Slurm: those of engines
    spanning its node from another, if it is its node's first rank (their node rank 0's are
    `started_by` theirs)."""
    first_rank: dict[int, int] = {}
    for slot in slots:
        for node_rank in range(slot.nnodes):
            own = slot.node_ranks(node_rank)
            first_rank[slot.node + node_rank] = min(first_rank.get(slot.node + node_rank, own[0]), *own)
    return [
        (slot, node_rank)
        for slot in slots
        for node_rank in range(1, slot.nnodes)
        if first_rank[slot.node + node_rank] == rank
    ]


def engine_id(cell: int, index: int) -> str:
    """The proxy's name for engine `index` of `cell`: the first keeps the cell's name (`cell3`), so a
    one-engine cell is named as it always was; the others are `cell3.e1`, ..."""
    return f"cell{cell}" if index == 0 else f"cell{cell}.e{index}"


def ranks_from_engines(slots: Sequence[EngineSlot], engine_s: Sequence[float], num_ranks: int) -> list[float]:
    """Each rank's time in an engine phase: its engine's (a rank no engine serves: 0)."""
    out = [0.0] * num_ranks
    for slot, seconds in zip(slots, engine_s, strict=True):
        for r in slot.ranks:
            out[r] = seconds
    return out


def ranks_from_work(phase_s: float, work_s: Sequence[float]) -> list[float]:
    """Each rank's time in a phase whose ranks start their own work together and which ends with the
    slowest of them (pull_weights: each rank reads its shard): a rank was done as much earlier as its
    work was shorter than the slowest rank's."""
    slowest = max(work_s)
    return [max(0.0, phase_s - (slowest - w)) for w in work_s]


def cell_phase_s(rank_s: Sequence[float]) -> float:
    """The cell's phase time: its slowest rank's (the phase ends when every rank has done it)."""
    return max(rank_s)
