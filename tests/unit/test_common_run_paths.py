"""RunPaths: the run directory's one layout."""

from pathlib import Path

from gyre.common.run_paths import RunPaths, record_path


def test_every_name_is_distinct_and_inside_the_run_directory():
    paths = RunPaths("run")
    named = [paths.config, paths.events, paths.ledger, paths.records, paths.sandboxes, paths.checkpoints]
    named += [paths.weights, paths.logs, paths.summary, paths.slurm, paths.figure("reward"), paths.record("g1-0")]
    named += [paths.cell_log(0), paths.cell_spec(0), paths.control_port(7), paths.core_port(7)]
    named += [paths.ranks_config(7), paths.rank_log(1, 7)]
    assert len(set(named)) == len(named)
    assert all(p.is_relative_to(Path("run")) and p != Path("run") for p in named)


def test_a_record_is_named_the_same_in_a_run_and_in_a_proxys_own_records_folder():
    assert RunPaths("run").record("g00003-1") == record_path(Path("run") / "records", "g00003-1")
    assert record_path("/tmp/mine", "g00003-1") == Path("/tmp/mine/g00003-1.jsonl")
