"""Weights into a cell of several ranks and several SGLang engines, on CPU: `gyre-train` with the
SGLang contract fake (the coordinator test's run, tests/integration/test_coordinator.py)."""

import json

import pytest

from tests.integration.test_coordinator import _env, _finish, _gyre_train, _sglang_fake, _taskset

pytestmark = pytest.mark.slow


def test_a_core_of_two_tp_ranks_publishes_by_update_weights_from_distributed_to_every_engine_of_its_cells(tmp_path):
    """Cells of two ranks (trainer TP=2) on two emulated nodes, each node served by its own SGLang
    contract fake: the core's rank 0 broadcasts the TP-gathered weights to all four engines, every
    update found generation paused, and every call is keyed by the version its engine served."""
    run_dir, audits = tmp_path / "run", tmp_path / "audits"
    audits.mkdir()
    cells = (
        "cluster.num_cells=2",
        "cluster.ranks_per_cell=2",
        "cluster.cell_nodes=2",
        "trainer.tensor_parallel_size=2",
    )
    summary = _finish(
        _gyre_train(
            run_dir,
            _taskset(tmp_path, ("apple", "river")),
            "num_steps=2",
            "scheduler.staleness=0",
            "coordinator.groups_per_step=2",
            *cells,
            *_sglang_fake(tmp_path),
            env=_env(
                GYRE_SGLANG_FAKE_AUDIT=str(audits / "engine{port}.jsonl"),  # one file per engine
                GYRE_SGLANG_FAKE_L3_DIR=str(tmp_path / "l3"),
            ),
        )
    )
    by_engine = {f.name: [json.loads(line) for line in f.read_text().splitlines()] for f in audits.iterdir()}
    assert len(by_engine) == 4, sorted(by_engine)  # two cells of two nodes, an engine each
    for name, audited in by_engine.items():
        updates = [a for a in audited if a.get("exclusive") == "update_weights_from_distributed"]
        assert updates and all(u["paused"] for u in updates), (name, audited)  # paused first, every engine
    calls = [a for audited in by_engine.values() for a in audited if "rid" in a]
    assert calls and all(c["extra_key"] == c["weight_version"] for c in calls)
    assert {"0", "1"} <= {c["weight_version"] for c in calls}
    assert summary["num_steps"] == 2 and summary["cell_ranks"] == 2
