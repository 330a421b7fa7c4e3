"""submitit and Gyre runs against the real dev Slurm cluster (tools/slurm-dev): het jobs, requeues, limits."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import submitit

from gyre.cells.config import ClusterConfig
from gyre.cells.placement import current_placement
from gyre.cells.slurm import rank_path
from gyre.coordinator.ledger import read_ledger
from gyre.launch.slurm import make_cell_components, make_hetjob_executor
from tests.integration.test_coordinator import (
    OVERRIDES,
    ROOT,
    _checkpointed,
    _events,
    _finish,
    _gyre_train,
    _records,
    _running,
    _taskset,
)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]

# On the dev cluster: a coordinator node + 3 cells of one fake node, each node asking for little, so
# CI jobs of the main checkout can share the cluster.
DEV = [
    "cluster.backend=slurm",
    "cluster.num_cells=3",
    "cluster.cell_nodes=1",
    "cluster.cpus_per_node=1",
    "cluster.mem_gb_per_node=1",
    "cluster.coordinator_cpus=1",
    "cluster.coordinator_mem_gb=2",
    "cluster.time_limit_min=20",
]


def test_autoexecutor_returns_a_result(tmp_path):
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="slurm")
    executor.update_parameters(timeout_min=5, mem_gb=1, cpus_per_task=1)
    job = executor.submit(pow, 3, 4)
    assert job.result() == 81


def test_hetjob_runs_one_task_per_cell(tmp_path):
    cluster = ClusterConfig(
        backend="slurm", num_cells=2, cell_nodes=2, cpus_per_node=1, mem_gb_per_node=1, time_limit_min=5
    )
    submitted = make_hetjob_executor(cluster, make_cell_components(cluster), tmp_path).submit(current_placement)
    # submitit counts only the first component's tasks; the step has one task per node of every cell.
    job = submitit.SlurmJob(folder=tmp_path, job_id=submitted.job_id, tasks=range(cluster.num_nodes))
    placements = [job.task(rank).result() for rank in range(cluster.num_nodes)]
    assert [p.het_group for p in placements] == [0, 0, 1, 1]
    assert [p.group_rank for p in placements] == [0, 1, 0, 1]
    assert {p.het_size for p in placements} == {2}
    assert placements[0].group_nodes != placements[2].group_nodes
    assert len({p.node for p in placements}) == 4, "each task runs on its own node"


def _wait_for_state(job: submitit.Job, prefix: str, timeout_s: float = 60.0) -> str:
    """The job's state once it starts with `prefix`, asking sacct each time (submitit's own polling
    backs off to 2, 4, 8, ... s after a submission)."""
    deadline = time.monotonic() + timeout_s
    while not (state := job.get_info(mode="force").get("State", "")).startswith(prefix):
        assert time.monotonic() < deadline, f"job {job.job_id} still {state!r}, not {prefix}"
        time.sleep(0.2)
    return state


def test_cancelled_job_is_reported_failed(tmp_path):
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="slurm")
    executor.update_parameters(timeout_min=5, mem_gb=1, cpus_per_task=1)
    job = executor.submit(time.sleep, 300)
    _wait_for_state(job, "RUNNING")
    job.cancel()
    _wait_for_state(job, "CANCELLED")
    job._results_timeout_s = 0  # as submitit's own tests do: no shared filesystem to wait 15 s for
    with pytest.raises(submitit.core.utils.UncompletedJobError):
        job.result()
    assert job.state.startswith("CANCELLED")


# ---- gyre-train cluster.backend=slurm ------------------------------------------------------------
def _components(job_id: str) -> dict[str, str]:
    """Het component -> its nodes, from accounting (the latest run of a requeued job)."""
    out = subprocess.run(
        ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "jobid,nodelist"], capture_output=True, text=True, check=True
    ).stdout
    return dict(line.split("|") for line in out.split())


def _latest_start_t(job_id: str) -> float:
    """When the job's latest run started (after a requeue: the restart), from accounting."""
    out = subprocess.run(
        ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "start"], capture_output=True, text=True, check=True
    ).stdout.split()[0]
    return time.mktime(time.strptime(out, "%Y-%m-%dT%H:%M:%S"))


def _first_running_t(run_dir: Path, after_t: float = 0.0) -> float | None:
    view = read_ledger(run_dir / "ledger.jsonl")
    return min(
        (e.t for es in view.history.values() for e in es if e.state == "running" and e.t > after_t), default=None
    )


def _check_ledger(run_dir: Path, num_steps: int) -> Counter:
    """Every execution reached an outcome; none trained twice; every step trained something."""
    view = read_ledger(run_dir / "ledger.jsonl")
    assert view.num_torn == 0
    assert all(view.outcome(eid) is not None for eid in view.history)
    trained = Counter(e.execution_id for es in view.history.values() for e in es if e.state == "trained")
    assert trained and max(trained.values()) == 1
    assert {e.step for es in view.history.values() for e in es if e.state == "trained"} == set(range(num_steps))
    return trained


def _wait_for(what: str, proc: subprocess.Popen, run_dir: Path, condition, timeout_s: float) -> None:
    deadline, coordinator = time.monotonic() + timeout_s, _CoordinatorWatch(run_dir)
    while not condition():
        assert proc.poll() is None, f"gyre-train ended waiting for {what}: {proc.stdout.read()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        coordinator.check()
        time.sleep(0.1)


def _finish_watching(proc: subprocess.Popen, run_dir: Path, timeout_s: float) -> dict:
    """`_finish`, failing fast if the run's coordinator dies first (see `_CoordinatorWatch`)."""
    deadline, coordinator = time.monotonic() + timeout_s, _CoordinatorWatch(run_dir)
    while proc.poll() is None:
        assert time.monotonic() < deadline, f"the run did not end within {timeout_s} s"
        coordinator.check()
        time.sleep(0.2)
    return _finish(proc, timeout_s=10)


class _CoordinatorWatch:
    """A coordinator that dies (a segfault) leaves its cells' tasks waiting, so the job, and
    gyre-train with it, would run on to the job's time limit: once the coordinator's task (the
    step's task 0, seen running before) has been gone for `grace_s` while gyre-train still waits,
    cancel the job and fail with the coordinator's log. Looks every `every_s` (it reads /proc)."""

    def __init__(self, run_dir: Path, grace_s: float = 120.0, every_s: float = 2.0):
        self.job_file, self.grace_s, self.every_s = run_dir / "slurm" / "job.json", grace_s, every_s
        self.seen, self.gone_since, self.next_t = False, None, 0.0

    def check(self) -> None:
        if time.monotonic() < self.next_t or not self.job_file.exists():
            return
        self.next_t = time.monotonic() + self.every_s
        job_id = json.loads(self.job_file.read_text())["job_id"]
        if _task_pids(job_id, 0):
            self.seen, self.gone_since = True, None
            return
        if not self.seen:  # the job is still pending
            return
        self.gone_since = self.gone_since or time.monotonic()
        if time.monotonic() - self.gone_since > self.grace_s:
            subprocess.run(["scancel", job_id], check=False)
            logs = "".join(p.read_text()[-3000:] for p in sorted(self.job_file.parent.glob(f"{job_id}_0_log.*")))
            pytest.fail(f"job {job_id}'s coordinator task ended {self.grace_s:.0f} s ago, its cells still run:\n{logs}")


@pytest.mark.timeout(1500)
def test_usr2_mid_step_checkpoints_requeues_resumes_a_core_of_two_ranks_and_continues_its_executions(tmp_path):
    """A core cell of 2 nodes training alone (colocate), over MPI control (Slurm's default): one
    srun task per rank, rank 0 its leader, rank 1 on the second node its follower, both computing
    micro-steps; USR2 while executions run with calls recorded checkpoints, requeues, and the
    restart resumes to the same step count and continues those executions under their ids."""
    run_dir, tasks = tmp_path / "run", _taskset(tmp_path)
    core = {**dict(o.split("=") for o in DEV), "cluster.num_cells": "1", "cluster.cell_nodes": "2"}
    proc = _gyre_train(run_dir, tasks, "num_steps=3", "scheduler=colocate", *(f"{k}={v}" for k, v in core.items()))
    job_file = run_dir / "slurm" / "job.json"
    _wait_for(
        "step-1 checkpoint, then an execution with a call recorded",
        proc,
        run_dir,
        lambda: (
            (run_dir / "events.jsonl").exists()
            and any(e["step"] == 1 for e in _events(run_dir, "checkpoint"))
            and bool(_calling(run_dir))
        ),
        900,
    )
    job_id = json.loads(job_file.read_text())["job_id"]
    in_flight = _calling(run_dir)
    signal_t = time.time()
    subprocess.run(
        ["scancel", "--signal=USR2", job_id], check=True
    )  # every step's tasks, as Slurm's preemption warning
    before = read_ledger(run_dir / "ledger.jsonl")
    saved = {e["step"]: e["weights_digest"] for e in _events(run_dir, "checkpoint")}

    summary = _finish(proc, timeout_s=1300)
    assert summary["num_steps"] == 3
    assert summary["cpu_quota"] == {"mechanism": "slurm", "job_id": job_id, "restart_count": 1}
    assert summary["cell_ranks"] == 2 and _ranks_computing(run_dir, 0) == {0, 1}  # the core's ranks compute
    follower = json.loads((run_dir / "slurm" / "cell0.r1.rank1.json").read_text())  # after the restart
    assert follower["num_ranks"] == 2 and follower["num_ops"] >= 1, follower  # it trained in lockstep
    nodes = subprocess.run(
        ["scontrol", "show", "hostnames", _components(job_id)[f"{job_id}+1"]], capture_output=True, text=True
    ).stdout.split()
    assert len(nodes) == 2 and follower["node"] == nodes[1], "one rank per node, rank 1 on the second"
    preempted = json.loads((run_dir / "slurm" / "preempted.r0.json").read_text())
    assert preempted["signal_t"] >= signal_t
    starts = _events(run_dir, "run_start")
    assert len(starts) == 2 and starts[1]["start_step"] >= 1
    assert starts[1]["weights_digest"] == saved[starts[1]["start_step"]]  # resumed from the checkpoint
    trained = _check_ledger(run_dir, 3)
    view = read_ledger(run_dir / "ledger.jsonl")
    for eid in before.history:  # nothing queued before the signal was lost: it has an outcome or a re-run
        if view.outcome(eid).reason == "interrupted":
            assert view.outcome(f"{eid}.r1") is not None and f"{eid}" not in trained
    assert (run_dir / "checkpoints" / "step_00000003").is_dir()
    continued = [eid for eid in in_flight if any(e.reason == "continued" for e in view.history[eid])]
    assert continued and summary["executions_continued"] >= len(continued), (in_flight, summary)
    assert all(view.outcome(eid) is not None and f"{eid}.r1" not in view.history for eid in continued)
    restarted_t = _latest_start_t(job_id)
    first = _first_running_t(run_dir, starts[1]["t"])  # None: the groups left were collected before the signal
    to_rollout = "none needed" if first is None else f"{first - starts[1]['t']:.1f} s"
    print(
        f"signal to checkpointed and closed: {preempted['closed_t'] - preempted['signal_t']:.1f} s; "
        f"requeue to the job running again: {restarted_t - preempted['requeue_t']:.1f} s; "
        f"then to cells ready (run_start): {starts[1]['t'] - restarted_t:.1f} s; "
        f"then to first rollout: {to_rollout}"
    )


def _calling(run_dir: Path) -> list[str]:
    """Running executions with a model call recorded: what USR2 interrupts mid-way."""
    return [eid for eid in _running(run_dir / "ledger.jsonl") if _records(run_dir, eid)]


@pytest.fixture
def small_partition():
    """A real partition of 4 nodes and a 5-minute limit, made for this test and deleted after it."""
    name = f"gyre-small-{os.getpid()}"
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True).stdout
    first4 = ",".join(sorted(set(nodes.split()))[:4])  # whatever this cluster calls its nodes
    subprocess.run(
        ["scontrol", "create", f"PartitionName={name}", f"Nodes={first4}", "MaxTime=5", "State=UP"], check=True
    )
    yield name
    subprocess.run(["scontrol", "delete", f"PartitionName={name}"], check=True)


@pytest.mark.parametrize(
    "overrides, key, says",
    [
        pytest.param(["cluster.partition=no-such-partition"], "cluster.partition", "not found", id="unknown-partition"),
        pytest.param(["cluster.num_cells=4"], "cluster.num_cells", "has 4", id="more-nodes"),
        pytest.param(
            ["cluster.num_cells=2", "cluster.cell_nodes=1", "cluster.time_limit_min=6"],
            "cluster.time_limit_min",
            "MaxTime of 5 min",
            id="time-above-max",
        ),
        pytest.param(
            ["cluster.allocation_nodes=3", "cluster.cell_nodes=2"],
            "cluster.cell_nodes",
            "do not divide",
            id="cell-does-not-divide",
        ),
    ],
)
def test_bad_cluster_config_fails_before_submitting(tmp_path, small_partition, overrides, key, says):
    run_dir = tmp_path / "run"
    partition = [] if "partition" in overrides[0] else [f"cluster.partition={small_partition}"]
    keys = {o.split("=")[0] for o in overrides}
    fits = {**dict(o.split("=") for o in DEV), "cluster.time_limit_min": "5"}  # the partition's limit
    dev = [f"{k}={v}" for k, v in fits.items() if k not in keys]
    proc = _gyre_train(run_dir, _taskset(tmp_path), *dev, *partition, *overrides)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and f"invalid config: {key}:" in out and says in out, out[-2000:]
    assert not (run_dir / "slurm" / "job.json").exists(), "nothing may be submitted"


def _task_pids(job_id: str, rank: int) -> list[int]:
    """Processes of one task of a job step: those whose environment says this job and this rank, and
    a step (the batch script and its srun say SLURM_PROCID=0 too, but no step)."""
    want, pids = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_PROCID={rank}".encode()}, []
    for proc in Path("/proc").iterdir():
        try:
            env = set((proc / "environ").read_bytes().split(b"\0"))
        except (OSError, ValueError):
            continue
        if proc.name.isdigit() and want <= env and any(v.startswith(b"SLURM_STEP_ID=") for v in env):
            pids.append(int(proc.name))
    return pids


FREE_SWITCHES = ["scheduler.rollout_to_train_s=0", "scheduler.train_to_rollout_s=0", "scheduler.min_dwell_s=0"]
"""Switches priced at nothing: a satellite leaves for any ready training work the remaining cells can
spare it for. With the default prices a satellite leaves only for ready work worth 2 x 12 s, which a
quiet box's toy steps may never reach (CI saw runs with no switch at all)."""

STEP_OF_SIX = [
    "coordinator.groups_per_step=6",  # a micro-step per group: work for every data-parallel rank
    "scheduler.staleness=0",  # nothing to serve once a step's batch is ready: every satellite leaves
]
SATELLITES_COMPUTE = [
    *STEP_OF_SIX,
    *FREE_SWITCHES,
    "scheduler.leave_window_s=0",  # the last satellite leaves once rollout is over, not 300 s later
    "trainer.core_computes_microsteps=false",
]
"""Elastic, and the satellites compute every micro-step (the core's ranks sum and step): ready work
waits for them, so a switch (~1 s here) never finds the core done with it. A core that computes
too is covered locally (tests/integration/test_coordinator.py, cells of two ranks)."""


def _training_satellites(run_dir: Path) -> list[int]:
    """The satellites whose last completed switch was to training."""
    roles = {e["cell"]: e["to_role"] for e in _events(run_dir, "role_switch")}
    return [c for c, role in sorted(roles.items()) if role == "train" and c != 0]


def _ranks_computing(run_dir: Path, cell: int) -> set[int]:
    """The ranks of `cell` whose micro-steps are in the run's events."""
    return {e["rank"] for e in _events(run_dir, "micro_step") if e["cell"] == cell}


@pytest.mark.timeout(1500)
def test_three_cells_of_two_nodes_serve_and_compute_on_every_satellite_rank_lose_a_training_one_and_replay_bitwise(
    tmp_path,
):
    """Cells of several ranks on Slurm (issue 27): 3 cells x 2 nodes, a task (a rank) per node,
    elastic, MPI control (Slurm's default). A satellite serves through an engine on each of its
    nodes (the second one started by that node's rank), and each switches them all, every rank
    timing its engine's phases. Both satellites switch and every rank of each computes
    micro-steps; the core's ranks sum them and step. SIGKILL of a training satellite's rank 1 (an
    srun task on its second node, nobody's child) loses the cell within seconds, through its link to rank 0, and the run
    finishes on the others. Its records, replayed locally by one core of 2 ranks in the run's
    batching order (both ranks computing micro-steps), train the same weights bit for bit."""
    run_dir, tasks = tmp_path / "run", _taskset(tmp_path, ("apple", "river"))
    proc = _gyre_train(run_dir, tasks, "num_steps=3", *DEV, "cluster.cell_nodes=2", *SATELLITES_COMPUTE)
    _wait_for(
        "the step-1 checkpoint, micro-steps of every rank of both satellites, a satellite training",
        proc,
        run_dir,
        lambda: (
            _checkpointed(run_dir, 1)
            and all(_ranks_computing(run_dir, c) == {0, 1} for c in (1, 2))
            and _training_satellites(run_dir)
        ),
        1200,
    )
    victim = _training_satellites(run_dir)[0]
    job_id = json.loads((run_dir / "slurm" / "job.json").read_text())["job_id"]
    pids = _task_pids(job_id, 2 * victim + 2)  # its rank 1 (1 coordinator task, then 2 tasks per cell)
    assert pids, f"cell {victim}'s rank 1"
    killed_t = time.time()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)

    summary = _finish_watching(proc, run_dir, timeout_s=1100)
    assert summary["num_steps"] == 3 and summary["cell_ranks"] == 2
    lost = [e for e in _events(run_dir, "failure") if e["component"] == f"cell{victim}"]
    assert len(lost) == 1 and "lost" in lost[0]["message"], lost
    assert lost[0]["t"] - killed_t < 30, "found by its link, not at the next collective"
    assert not [e for e in _events(run_dir, "failure") if e["component"] != f"cell{victim}"]
    assert json.loads((run_dir / "slurm" / "cell0.r0.json").read_text())["coordinator_address"].startswith("mpi:")
    _check_ledger(run_dir, 3)
    assert (run_dir / "checkpoints" / "step_00000003").is_dir()
    assert victim in {e["cell"] for e in _events(run_dir, "role_switch") if e["to_role"] == "train"}
    other = 3 - victim  # the surviving satellite: its rank 1 followed to the end, on a node of its own
    core, satellite = (json.loads(rank_path(run_dir / "slurm", cell, 0, 1).read_text()) for cell in (0, other))
    assert (
        core["ops"]["core_fold"] >= 3 and core["ops"]["core_apply"] == 3 and core["host"] == "127.0.0.1"
    )  # the dev cluster's nodes' address
    assert satellite["ops"]["link"] == 1 and core["node"] != satellite["node"]
    assert len(satellite["engine_urls"]) == 1 and satellite["ops"]["engine_urls"] == 1  # its node's, handed to rank 0
    _assert_served_and_switched_on_both_nodes(run_dir, (1, 2))
    print(f"satellite rank SIGKILLed to its cell lost: {lost[0]['t'] - killed_t:.1f} s")

    # Replayed locally (cheaper than a second het job) by one core of 2 data-parallel ranks.
    replay = tmp_path / "replay"
    records = [f"records={run_dir / 'records'}", "mode=replay", "cluster.num_cells=1", "cluster.ranks_per_cell=2"]
    replayed = _finish(_gyre_train(replay, tasks, "num_steps=3", *records, *STEP_OF_SIX))
    assert replayed["cell_ranks"] == 2 and _ranks_computing(replay, 0) == {0, 1}  # the core computes there
    gaps = _weight_gaps(run_dir, replay)
    print(f"run against its replay, largest weight difference per checkpoint: {gaps}")
    assert sorted(gaps) == [1, 2, 3] and set(gaps.values()) == {0.0}


def _assert_served_and_switched_on_both_nodes(run_dir: Path, satellites: tuple[int, ...]) -> None:
    """Each satellite switched its engines on both its nodes, both ranks timing every engine phase
    (the proxy's verbs on each engine's id: both registered under the cell), and a satellite's
    engines on both nodes served calls (not each satellite's: one may leave to train after a call)."""
    from gyre.cells.leader import ENGINE_PHASES

    for cell in satellites:
        switches = [e for e in _events(run_dir, "role_switch") if e["cell"] == cell]
        timed = [e["rank_phases"][p.value] for e in switches for p in ENGINE_PHASES if p.value in e["rank_phases"]]
        assert switches and timed and all(len(t) == 2 and min(t) > 0 for t in timed), switches
    served = [{c["engine_id"] for c in _events(run_dir, "model_call") if c["cell"] == cell} for cell in satellites]
    assert any(engines == {f"cell{cell}", f"cell{cell}.e1"} for cell, engines in zip(satellites, served)), served


def _weight_gaps(run_a: Path, run_b: Path) -> dict[int, float]:
    """Step -> the largest difference of any weight between the two runs' checkpoints of it (0.0:
    bit for bit; a difference says where the runs parted, which a digest would not)."""
    from omegaconf import OmegaConf

    from gyre.config import validate
    from gyre.coordinator.config import GyreConfig
    from gyre.train.checkpoint import CheckpointManager, list_checkpoints
    from gyre.train.trainer import Trainer

    saved = OmegaConf.load(run_b / ".hydra" / "config.yaml")  # the run's model and trainer, run locally
    cfg = validate(OmegaConf.merge(OmegaConf.structured(GyreConfig), saved))
    trainer = Trainer(cfg.model, cfg.trainer)

    def weights(path: Path):
        CheckpointManager(path.parent, keep_last=1).load(trainer, path)
        return trainer.flat.weights.detach().clone()

    a, b = dict(list_checkpoints(run_a / "checkpoints")), dict(list_checkpoints(run_b / "checkpoints"))
    return {step: float((weights(a[step]) - weights(b[step])).abs().max()) for step in sorted(a.keys() & b.keys())}


def _check_het_job(run_dir: Path, summary: dict) -> None:
    """The run went through one het job: a component per cell plus the coordinator's, each on its own
    nodes; every cell's leader got its spec and did not fail; the satellites switched roles."""
    assert summary["cpu_quota"]["mechanism"] == "slurm"
    job = json.loads((run_dir / "slurm" / "job.json").read_text())
    assert summary["cpu_quota"]["job_id"] == job["job_id"] and summary["cpu_quota"]["restart_count"] == 0
    components = _components(job["job_id"])
    assert sorted(components) == [f"{job['job_id']}+{k}" for k in range(4)], components
    assert len(set(components.values())) == 4, "each component on its own nodes"
    for k in range(3):
        assert (run_dir / "slurm" / f"cell{k}.r0.json").exists()
        assert not (run_dir / "slurm" / f"cell{k}.r0.failed").exists()
    assert summary["num_role_switches"] >= 1
    print(f"submission to first rollout: {_first_running_t(run_dir) - job['submitted_t']:.1f} s")


@pytest.mark.timeout(1800)
def test_a_three_job_sweep_over_modes_runs_each_as_a_two_step_het_job_of_its_own(tmp_path):
    """`gyre-train -m hydra/launcher=submitit_slurm`: each sweep job is a Slurm job of its own, whose
    gyre-train submits the run's het job (not inheriting the launcher job's identity) and waits; the
    elastic one is checked as a whole het job (components, leaders, role switches, checkpoint)."""
    sweep_dir = tmp_path / "sweep"
    launcher = [
        "hydra/launcher=submitit_slurm",
        f"hydra.launcher.submitit_folder={sweep_dir}/.submitit",
        "hydra.launcher.timeout_min=30",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=2",
    ]
    cmd = [
        sys.executable,
        "-m",
        "gyre.launch.train",
        "-m",
        f"hydra.sweep.dir={sweep_dir}",
        *launcher,
        f"tasks.path={_taskset(tmp_path)}",
        *OVERRIDES,
        "scheduler=elastic,async,colocate",
        "num_steps=2",
        *DEV,
        *FREE_SWITCHES,
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    jobs = set()
    for num, mode in enumerate(["elastic", "async", "colocate"]):
        run_dir = sweep_dir / str(num)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["num_steps"] == 2 and _events(run_dir, "run_start")[0]["mode"] == mode
        _check_ledger(run_dir, 2)
        assert (run_dir / "checkpoints" / "step_00000002").is_dir()
        if mode == "elastic":
            _check_het_job(run_dir, summary)
        jobs.add(json.loads((run_dir / "slurm" / "job.json").read_text())["job_id"])
    assert len(jobs) == 3
