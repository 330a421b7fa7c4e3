"""A cell's engines (one per node on CPU, per engine.tp_size ranks on GPU) and each rank's share of a switch phase."""

import pytest

from gyre.cells.serving import (
    EngineSlot,
    cell_phase_s,
    engine_id,
    joined_by,
    plan_cell,
    plan_engines,
    ranks_from_engines,
    ranks_from_work,
    started_by,
)
from gyre.errors import ConfigError


def test_a_cell_runs_an_engine_per_node_on_cpu_and_per_tp_size_ranks_of_a_node_on_gpu_started_by_its_first_rank():
    assert plan_engines(1, 1, 4, on_gpu=False) == [EngineSlot(0, 0, (0,), 0)]
    assert plan_engines(4, 2, 1, on_gpu=False) == [EngineSlot(0, 0, (0, 1), 0), EngineSlot(1, 1, (2, 3), 0)]
    gpu = plan_engines(8, 2, 2, on_gpu=True)
    assert [(s.node, s.ranks, s.base_gpu_id) for s in gpu] == [
        (0, (0, 1), 0),
        (0, (2, 3), 2),
        (1, (4, 5), 0),
        (1, (6, 7), 2),
    ]
    # one trainer rank per node: its engine spans tp_size GPUs of that node, as before cells had ranks
    assert plan_engines(2, 2, 4, on_gpu=True) == [EngineSlot(0, 0, (0,), 0), EngineSlot(1, 1, (1,), 0)]
    assert [engine_id(3, s.index) for s in gpu] == ["cell3", "cell3.e1", "cell3.e2", "cell3.e3"]
    # on Slurm each node's first rank starts its node's engines: ranks 0 and 4 here, no other rank
    assert [started_by(gpu, r) for r in range(8)] == [gpu[:2], [], [], [], gpu[2:], [], [], []]


@pytest.mark.parametrize(
    "ranks, nodes, tp, key",
    [
        pytest.param(3, 2, 1, "cluster.cell_nodes", id="ranks-not-split-over-nodes"),
        pytest.param(1, 2, 1, "cluster.cell_nodes", id="fewer-ranks-than-nodes"),
        pytest.param(6, 1, 4, "engine.tp_size", id="tp-not-dividing-a-nodes-gpus"),
    ],
)
def test_a_cell_whose_engines_cannot_be_laid_out_is_refused_naming_the_key(ranks, nodes, tp, key):
    with pytest.raises(ConfigError) as err:
        plan_engines(ranks, nodes, tp, on_gpu=True)
    assert err.value.key == key


def test_each_rank_gets_its_engines_or_its_own_works_time_and_the_cell_its_slowest_ranks():
    slots = plan_engines(4, 2, 1, on_gpu=False)
    by_rank = ranks_from_engines(slots, [0.5, 0.75], 4)
    assert by_rank == [0.5, 0.5, 0.75, 0.75] and cell_phase_s(by_rank) == 0.75
    # a 1.0 s pull whose ranks read their shards in 0.25 and 0.5 s: rank 0 was done 0.25 s earlier
    by_rank = ranks_from_work(1.0, [0.25, 0.5])
    assert by_rank == [0.75, 1.0] and cell_phase_s(by_rank) == 1.0
    with pytest.raises(ValueError):  # one time per engine, no more and no fewer
        ranks_from_engines(slots, [0.5], 4)


@pytest.mark.parametrize(
    "gpus, nodes, tp",
    [
        pytest.param(g, n, tp, id=f"{g}gpus-{n}nodes-tp{tp}")
        for g in (1, 2, 8)
        for n in (1, 2)
        for tp in (1, 2, 4, 8)
        if tp <= g
    ],
)
def test_a_gpu_cell_puts_one_rank_on_each_gpu_and_each_gpu_in_exactly_one_engine(gpus, nodes, tp):
    layout = plan_cell(gpus * nodes, nodes, gpus, tp, on_gpu=True, trainer_tp=tp)
    assert [(r.node, r.local_rank, r.device) for r in layout.ranks] == [
        (n, g, g) for n in range(nodes) for g in range(gpus)
    ]
    assert layout.node_devices(0) == list(range(gpus))
    assert all(r.exports() == {"LOCAL_RANK": str(r.local_rank)} for r in layout.ranks)
    # engines tile each node's GPUs: tp_size each, never two on one GPU; data parallel is the rest
    for node in range(nodes):
        used = [gpu for e in layout.engines if e.node == node for gpu in range(e.base_gpu_id, e.base_gpu_id + tp)]
        assert sorted(used) == list(range(gpus))
    assert len(layout.engines) == gpus * nodes // tp
    # TP groups are consecutive ranks of one node, data parallel the rest (megatron-core's order)
    assert [(r.tp_rank, r.dp_rank) for r in layout.ranks] == [(r % tp, r // tp) for r in range(gpus * nodes)]
    assert all(len({r.node for r in layout.ranks if r.dp_rank == d}) == 1 for d in range(gpus * nodes // tp))
    for r in layout.ranks:  # a rank's GPU belongs to its engine: the two take turns on it
        engine = layout.engines[r.engine]
        assert engine.node == r.node and engine.base_gpu_id <= r.device < engine.base_gpu_id + tp


def test_a_cpu_cell_plans_ranks_without_devices_and_an_engine_per_node():
    layout = plan_cell(4, 2, 0, 1, on_gpu=False)
    assert [(r.node, r.local_rank, r.device, r.engine) for r in layout.ranks] == [
        (0, 0, None, 0),
        (0, 1, None, 0),
        (1, 0, None, 1),
        (1, 1, None, 1),
    ]


@pytest.mark.parametrize(
    "ranks, nodes, gpus, tp, key",
    [
        pytest.param(1, 1, 8, 1, "cluster.ranks_per_node", id="one-rank-on-8-gpus-leaves-7-idle"),
        pytest.param(4, 1, 2, 1, "cluster.ranks_per_node", id="two-ranks-a-gpu"),
        pytest.param(2, 1, 2, 4, "engine.tp_size", id="engine-wider-than-a-node"),
        pytest.param(8, 1, 8, 3, "engine.tp_size", id="engines-not-tiling-a-node"),
        pytest.param(4, 2, 2, 1, "trainer.tensor_parallel_size", id="trainer-tp-across-nodes"),
    ],
)
def test_a_gpu_layout_that_idles_or_shares_a_gpu_is_refused_naming_the_key(ranks, nodes, gpus, tp, key):
    with pytest.raises(ConfigError) as err:
        plan_cell(ranks, nodes, gpus, tp, on_gpu=True, trainer_tp=4 if key.startswith("trainer") else tp)
    assert err.value.key == key


def test_an_engine_wider_than_a_node_spans_whole_nodes_one_process_each_served_by_node_rank_0():
    """engine.nnodes=2 on nodes of 4 GPUs: tp_size 8, one server on nodes 0-1 and one on 2-3; each
    node's first rank starts its node's process, node rank 0's (started_by) or the other's (joined_by)."""
    slots = plan_engines(16, 4, 8, on_gpu=True, nnodes=2)
    assert slots == [EngineSlot(0, 0, tuple(range(8)), 0, 2), EngineSlot(1, 2, tuple(range(8, 16)), 0, 2)]
    assert plan_engines(16, 4, 8, on_gpu=True) == slots  # the leader's plan: tp_size fills two nodes
    assert [slots[0].node_ranks(k) for k in (0, 1)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [started_by(slots, r) for r in (0, 4, 8, 12)] == [slots[:1], [], slots[1:], []]
    assert [joined_by(slots, r) for r in (0, 4, 8, 12)] == [[], [(slots[0], 1)], [], [(slots[1], 1)]]
    assert all(joined_by(slots, r) == [] == started_by(slots, r) for r in range(16) if r % 4)
    layout = plan_cell(16, 4, 4, 8, on_gpu=True, trainer_tp=4, nnodes=2)
    assert [r.engine for r in layout.ranks] == [0] * 8 + [1] * 8  # each GPU in exactly one engine
    assert plan_engines(8, 2, 4, on_gpu=True, nnodes=1) == plan_engines(8, 2, 4, on_gpu=True)


@pytest.mark.parametrize(
    "ranks, nodes, tp, nnodes, on_gpu, key",
    [
        pytest.param(16, 4, 4, 2, True, "engine.nnodes", id="not-whole-nodes"),
        pytest.param(12, 3, 8, 2, True, "engine.nnodes", id="nodes-not-tiled"),
        pytest.param(12, 3, 8, None, True, "engine.tp_size", id="derived-span-not-tiling"),
        pytest.param(4, 2, 1, 2, False, "engine.nnodes", id="cpu-engine-spans-nodes"),
        pytest.param(8, 2, 8, 1, True, "engine.tp_size", id="one-node-too-narrow"),
    ],
)
def test_an_engine_spanning_nodes_that_does_not_tile_them_is_refused_naming_the_key(
    ranks, nodes, tp, nnodes, on_gpu, key
):
    with pytest.raises(ConfigError) as err:
        plan_engines(ranks, nodes, tp, on_gpu, nnodes)
    assert err.value.key == key
