"""The coordinator's pure parts: the execution ledger, the live staleness mask, CPU quotas, losing a
satellite whose engine cannot be reached or that reports a failure."""

import asyncio
import os
import threading
from types import SimpleNamespace

import aiohttp
import numpy as np
import pytest

from gyre.cells.base import CellError
from gyre.cells.local import LocalCell
from gyre.cells.quota import PERIOD_US, SHARES_V1, WEIGHT_V2, make_quota, quota_us
from gyre.common.run_paths import RunPaths
from gyre.control.messages import CellReady, Failure
from gyre.control.transport import ChannelClosed, ChannelTimeout
from gyre.coordinator.batching import mask_stale
from gyre.coordinator.build import _accept_cells
from gyre.coordinator.ledger import ExecutionLedger, LedgerEntry, read_ledger
from gyre.coordinator.loop import RunFailed, _load_serving, _on_message
from gyre.coordinator.rollouts import HarnessStartError, check_harness_started
from gyre.engines.config import EngineConfig
from gyre.engines.launch import attach_engine
from gyre.engines.published import PublishedWeights
from gyre.scheduler.cells import Role, make_cells
from gyre.trajectory.paths import PathSample
from gyre.trajectory.process import TrainingSample


def test_ledger_reads_back_states_outcomes_and_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = ExecutionLedger(path)
    for state, extra in [
        ("queued", {}),
        ("running", {}),
        ("finished", {"score": 0.5}),
        ("excluded", {"reason": "uniform_group"}),
    ]:
        ledger.append(LedgerEntry("a", state, 1.0, group=0, task_id="t", **extra))
    ledger.append(LedgerEntry("b", "queued", 2.0, group=0, task_id="t"))
    ledger.append(LedgerEntry("b", "timed_out", 3.0, group=0, task_id="t", score=0.25))
    ledger.append(LedgerEntry("b", "trained", 4.0, group=0, step=0))
    ledger.close()
    with open(path, "ab") as f:
        f.write(b'{"execution_id": "c", "sta')  # the machine died mid-write
    view = read_ledger(path)
    assert view.num_torn == 1 and set(view.history) == {"a", "b"}
    assert view.outcome("a").state == "finished" and view.outcome("a").score == 0.5  # the rollout's outcome
    assert view.trained_step("b") == 0 and view.trained_step("a") is None
    assert view.counts() == {"finished": 1, "timed_out": 1, "trained": 1, "excluded/uniform_group": 1}


def test_ledger_refuses_an_unknown_state(tmp_path):
    ledger = ExecutionLedger(tmp_path / "l.jsonl")
    with pytest.raises(ValueError, match="lost"):
        ledger.append(LedgerEntry("a", "lost", 0.0))


def _sample(versions: list[int]) -> TrainingSample:
    """A path of 2 context tokens then one target per entry of `versions` (its weight version)."""
    n = 2 + len(versions)
    target = np.array([False, False] + [True] * len(versions))
    path = PathSample(
        execution_id="e",
        leaf_call_id="c",
        path_class="main",
        tokens=np.arange(n, dtype=np.int32),
        target_mask=target,
        unique_mask=target.copy(),
        copies=target.astype(np.int32),
        logprobs=np.where(target, np.float32(-1.0), np.float32(0.0)).astype(np.float32),
        versions=np.array([-1, -1] + versions, dtype=np.int64),
    )
    return TrainingSample(path=path, loss_weights=target.astype(np.float32) / len(versions), advantage=1.0)


@pytest.mark.parametrize(
    "versions, step, staleness, masked, kept_targets",
    [
        pytest.param([3, 3, 4], 4, 1, 0, 3, id="all-within-the-bound"),
        pytest.param([1, 2, 3, 3], 4, 1, 2, 2, id="older-spans-masked"),
        pytest.param([5, 6], 4, 0, 0, 2, id="newer-than-the-step"),
        pytest.param([1, 1], 4, 1, 2, 0, id="nothing-left-dropped"),
    ],
)
def test_stale_targets_are_masked_by_the_per_span_rule(versions, step, staleness, masked, kept_targets):
    kept, n = mask_stale(_sample(versions), step, staleness)
    assert n == masked
    if kept_targets == 0:
        assert kept is None
        return
    assert int(kept.path.target_mask.sum()) == kept_targets
    on = kept.path.target_mask
    assert (kept.path.versions[on] >= step - staleness).all() and (kept.loss_weights[~on] == 0).all()
    assert (kept.path.logprobs[~on] == 0).all() and not kept.path.unique_mask[~on].any()


def test_quota_uses_cgroup_v2_then_v1_then_pins_cores_and_caps_when_asked(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu\n")
    q = make_quota("cellA", 0.5, 0, root=v2)
    assert q.mechanism == "cgroup_v2" and (v2 / "cellA" / "cpu.max").read_text() == f"{quota_us(0.5)} {PERIOD_US}"
    assert (v2 / "cellA" / "cpu.weight").read_text() == str(WEIGHT_V2)  # outweighs the harnesses

    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    q = make_quota("cellB", 1.5, 0, root=v1)
    assert q.mechanism == "cgroup_v1" and (v1 / "cpu" / "cellB" / "cpu.cfs_quota_us").read_text() == "150000"
    assert (v1 / "cpu" / "cellB" / "cpu.shares").read_text() == str(SHARES_V1)

    q = make_quota("cellD", 0.5, 0, root=v2, capped=False)  # a cell's: capped once its leader is ready
    assert q.mechanism == "cgroup_v2" and not (v2 / "cellD" / "cpu.max").exists()  # the kernel's: no cap
    q.cap()
    assert (v2 / "cellD" / "cpu.max").read_text() == f"{quota_us(0.5)} {PERIOD_US}"
    q = make_quota("cellE", 1.5, 0, root=v1, capped=False)
    assert not (v1 / "cpu" / "cellE" / "cpu.cfs_quota_us").exists()
    q.cap()
    assert (v1 / "cpu" / "cellE" / "cpu.cfs_quota_us").read_text() == "150000"

    q = make_quota("cellC", 1, 1, root=tmp_path / "none")
    assert q.mechanism == "affinity" and {int(c) for c in q.path.split(",")} <= os.sched_getaffinity(0)
    assert quota_us(0.001) == 1000  # the kernel's minimum


def test_a_local_cell_is_capped_once_its_leader_is_ready(tmp_path):
    capped = []
    quota = SimpleNamespace(cap=lambda: capped.append(True))
    spec = SimpleNamespace(index=0, engine=EngineConfig(), model=None)
    cell = LocalCell(spec, make_cells(1, 1)[0], RunPaths(tmp_path), quota)
    assert not capped  # its start runs uncapped
    cell.ready("channel", ["http://127.0.0.1:1"])
    assert capped and cell.channel == "channel" and cell.engine_urls == ["http://127.0.0.1:1"]


class _Cell:
    def __init__(self, index: int, engine_url: str):
        self.index, self.engines = index, [attach_engine(EngineConfig(), None, engine_url)]
        self.engine_ids = [f"cell{index}"]
        self.state, self.stopped = make_cells(3, 1)[index], threading.Event()

    def stop(self) -> None:
        self.stopped.set()


class _Events:
    def __init__(self):
        self.failures = []

    def failure(self, component: str, message: str) -> None:
        self.failures.append((component, message))


class _Admin:
    def __init__(self):
        self.calls = []

    async def hold_calls(self, engine_id: str) -> None:
        self.calls.append((engine_id, "hold"))

    async def set_weight_version(self, engine_id: str, version: int | None) -> None:
        self.calls.append((engine_id, version))


def test_a_satellite_whose_engine_cannot_take_new_weights_is_lost_but_an_unreachable_core_ends_the_run(reserve_port):
    """A leader can be dead before its channel says so (MPI knows a dead peer only by silence): the
    weight push after a step is where the coordinator finds out; it must not end the run. The proxy
    held the engine's calls during the load and was told after it that the load failed (the engine
    serves the version it served before)."""
    core, satellite, events = (
        _Cell(0, f"http://127.0.0.1:{reserve_port()}"),
        _Cell(2, f"http://127.0.0.1:{reserve_port()}"),
        _Events(),
    )
    parts = SimpleNamespace(core=core, admin=_Admin())
    weights = PublishedWeights(3, "disk", {"path": "/nonexistent"})
    asyncio.run(_load_serving([satellite], weights, parts, events, now=5.0))
    assert satellite.state.role == Role.LOST and satellite.stopped.wait(10)
    assert events.failures[0][0] == "cell2" and "weight version 3" in events.failures[0][1]
    assert parts.admin.calls == [("cell2", "hold"), ("cell2", None)]
    with pytest.raises(aiohttp.ClientConnectionError):
        asyncio.run(_load_serving([core], weights, parts, events, now=5.0))


def test_a_satellite_that_reports_a_failure_is_lost_but_the_cores_failure_ends_the_run(reserve_port):
    """A leader reports what went wrong in a switch or a step (an engine that died, say) and keeps
    serving: for a satellite that is its loss, as its death would be, not the run's end."""
    core, satellite, events = (
        _Cell(0, f"http://127.0.0.1:{reserve_port()}"),
        _Cell(2, f"http://127.0.0.1:{reserve_port()}"),
        _Events(),
    )
    parts = SimpleNamespace(core=core)

    def report(cell):
        msg = Failure(cell.index, "RoleSwitch: EngineError('engine exited')")
        asyncio.run(_on_message(msg, cell, parts, None, None, events, None, 5.0, False))

    report(satellite)
    assert satellite.state.role == Role.LOST and satellite.stopped.wait(10)
    assert events.failures == [("cell2", "lost: failed: RoleSwitch: EngineError('engine exited')")]
    with pytest.raises(RunFailed, match="cell 0: RoleSwitch"):
        report(core)


def test_satellites_async_starts_in_training_switch_in_so_they_join_the_cores_step():
    """A satellite trains only after pulling the core's weights and joining its step, which the
    switch does: async's training pool starts serving and switches at once; the core stays put."""
    from gyre.coordinator.build import _join_training, _start_role
    from gyre.scheduler.config import SchedulerConfig
    from gyre.scheduler.policy import make_policy

    policy = make_policy(SchedulerConfig(mode="async", async_train_cells=2), 3)
    switched = []
    cells = [
        SimpleNamespace(state=s, begin_switch=lambda *a, i=s.index: switched.append((i, *a))) for s in make_cells(3, 1)
    ]
    for cell, role in zip(cells, policy.initial_roles()):
        cell.state.role = _start_role(role, cell.state.is_core)
    parts = SimpleNamespace(
        cells=cells,
        policy=policy,
        initial=SimpleNamespace(weights=PublishedWeights(0, "disk", {"path": "d"})),
        core_address="tcp://core",
    )
    _join_training(parts)
    assert [(i, target, weights, address) for i, target, _, weights, address in switched] == [
        (1, Role.TRAIN, PublishedWeights(0, "disk", {"path": "d"}), "tcp://core")
    ]


def test_a_resumed_execution_keeps_its_outcome_or_exclusion_reason(tmp_path):
    """Resume rebuilds evaluations from the ledger: a budget_exhausted exclusion stays one (it is an
    outcome), any other exclusion is not trainable, a score is kept."""
    from gyre.coordinator.source import Group, recorded
    from gyre.tasks.taskset import toy_taskset

    group = Group(0, 0, toy_taskset().tasks[0])
    outcomes = [
        recorded(LedgerEntry("e", state, 0.0, reason=reason, score=score), group, tmp_path).evaluation
        for state, reason, score in [
            ("timed_out", "", 0.4),
            ("excluded", "budget_exhausted", None),
            ("excluded", "harness_failed", None),
        ]
    ]
    assert [(e.outcome, e.score) for e in outcomes] == [
        ("timed_out", 0.4),
        ("budget_exhausted", None),
        ("evaluator_error", None),
    ]


def test_held_out_tasks_run_at_the_first_and_last_weights_never_in_the_ledger(tmp_path):
    """Held-out executions go ahead of the groups under version 0 and under the last version, only
    then is the run done, and their results reach the events, not the ledger."""
    import hydra

    from gyre.common import CONF_DIR
    from gyre.config import register_configs, validate
    from gyre.coordinator.ledger import ExecutionLedger, read_ledger
    from gyre.coordinator.rollouts import Rollouts
    from gyre.tasks.taskset import toy_taskset
    from gyre.trajectory.rewards import Evaluation

    register_configs()
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = validate(hydra.compose(config_name="config", overrides=["num_steps=2", "tasks.eval_every=0"]))
    results = []
    events = SimpleNamespace(execution_state=lambda entry, step: None, held_out=results.append)
    ledger = ExecutionLedger(tmp_path / "ledger.jsonl")
    r = Rollouts(cfg, tmp_path, toy_taskset(), ledger, events)
    train = SimpleNamespace(version=0, uncheckpointed=False)
    r.admit_held_out(0)
    r.admit_groups(0)  # the first weights' held-out rollouts run alone
    num_held_out = len(r.held_out_tasks) * cfg.tasks.eval_samples
    assert len(r.held_out_tasks) == 8 and [ex.held_out for ex in r.queue] == [0] * num_held_out
    assert r.counts(0) == (num_held_out, 0, 0, 0)
    r.admit_held_out(0)  # once per version
    assert len(r.queue) == num_held_out
    ex = r.queue.pop(0)
    ex.evaluation = Evaluation("finished", 0.6)
    r._log(ex, "finished", score=0.6)
    assert results == [ex] and not [e for e in read_ledger(tmp_path / "ledger.jsonl").entries if "heldout" in e]
    r.queue.clear()
    r.admit_groups(0)
    step = cfg.coordinator.groups_per_step * cfg.coordinator.group_size
    assert r.counts(0) == (2 * step, step, 0, 0)  # then steps 0 and 1 (staleness 1)
    r.running.append(r.queue.pop())  # a step-1 execution starts: ahead of step 0, not of step 1
    assert r.counts(0) == (2 * step - 1, step - 1, 1, 1) and r.counts(1) == (2 * step - 1, 0, 1, 0)
    r.running.clear()
    train.version = 2
    assert not r.done(train)  # the held-out rollouts under the last weights are still to come
    r.queue.clear()
    r.admit_held_out(2)
    assert len(r.queue) == num_held_out and r.queue[0].held_out == 2 and not r.done(train)
    r.queue.clear()
    assert r.done(train)
    ledger.close()


class _Channel:
    def __init__(self, first):
        self.first, self.closed = first, False

    def recv(self, timeout_s=None):
        if isinstance(self.first, Exception):
            raise self.first
        return self.first

    def close(self):
        self.closed = True


def test_a_leader_channel_that_closes_before_its_cell_ready_is_dropped_and_the_others_accepted():
    """An MPI leader whose handshake failed half way connects again; the channel the listener
    accepted for the failed attempt closes without a CellReady and must not end the run."""
    gone, core, satellite = _Channel(ChannelClosed("silent")), _Channel(CellReady(0, [])), _Channel(CellReady(1, []))
    channels = iter([gone, satellite, core])
    listener = SimpleNamespace(accept=lambda timeout_s: next(channels))
    cells = [SimpleNamespace(check_alive=lambda: None) for _ in range(2)]
    for cell in cells:
        cell.ready = lambda channel, urls, cell=cell: setattr(cell, "got", channel)
    parts = SimpleNamespace(cells=cells, listener=listener, core_address="", initial=None)
    _accept_cells(parts, timeout_s=60)
    assert gone.closed and (cells[0].got, cells[1].got) == (core, satellite) and parts.initial == core.first


def test_leaders_not_ready_by_the_deadline_end_the_start_with_how_many_are_missing():
    def accept(timeout_s):
        raise ChannelTimeout("no leader")

    core = _Channel(CellReady(0, []))
    channels = iter([core])
    listener = SimpleNamespace(accept=lambda timeout_s: next(channels, None) or accept(timeout_s))
    cells = [SimpleNamespace(check_alive=lambda: None, ready=lambda channel, urls: None) for _ in range(3)]
    parts = SimpleNamespace(cells=cells, listener=listener, core_address="", initial=None)
    with pytest.raises(CellError, match="2 cell leader"):
        _accept_cells(parts, timeout_s=0.05)
    assert parts.initial == core.first


def test_the_coordinators_steps_are_plain_maps_of_groups_whose_ready_work_the_policy_sees(monkeypatch):
    """A group is ready work (its tokens) until the core reports every id of it trained; an excluded
    group counts toward the batch; a step takes at most G groups; the staleness bound is checked
    again when a group is sent; the step ends once every group of it is accounted for."""
    from gyre.control.messages import EndStep, MicroBatches, StepDone, StepProgress
    from gyre.coordinator import training
    from gyre.coordinator.batching import GroupBatch
    from gyre.coordinator.source import Group
    from gyre.scheduler.cells import SchedulerError
    from gyre.scheduler.streaming import StalenessError
    from gyre.trajectory.config import TrajectoryConfig

    sizes = {0: [3, 4], 1: [], 2: [5], 3: [6]}  # group -> its micro-batches' tokens (1: excluded)
    versions = {0: 0, 1: None, 2: 0, 3: 0}

    def batch(executions, step, *args):
        gi = int(executions[0][0])
        mbs = [SimpleNamespace(num_tokens=n) for n in sizes[gi]]
        return GroupBatch(micro_batches=mbs, rewards={}, min_version=versions[gi] if mbs else None)

    monkeypatch.setattr(training, "make_group_batch", batch)
    train = training.Training(
        groups_per_step=2, staleness=0, trajectory=TrajectoryConfig(), max_tokens=0, version=0, train_tok_s=1.0
    )

    def group(gi, step):
        ex = SimpleNamespace(records_path=str(gi), evaluation=None)
        return Group(index=gi, step=step, task=None, executions=[ex])

    train.add_group(group(0, 0))
    train.add_group(group(2, 1))  # placed ahead
    assert (train.ready_tokens(), train.ready_tokens_ahead(), train.batch_ready()) == (7, 5, False)
    msgs = train.to_send()
    assert [type(m) for m in msgs] == [MicroBatches] and msgs[0].group == 0
    train.add_group(group(1, 0))  # excluded: accounted, nothing to train
    assert train.batch_ready() and [type(m) for m in train.to_send()] == [EndStep] and train.optimizing
    with pytest.raises(SchedulerError, match="more than 2 groups"):
        train.add_group(group(3, 0))
    train.on_progress(StepProgress(0, [(0, 0, 0)]))
    assert train.ready_tokens() == 7 and not train.step_started()
    train.on_progress(StepProgress(0, [(0, 0, 0), (0, 0, 1)]))
    assert train.ready_tokens() == 0 and train.step_started()
    done = StepDone(0, 1, {"num_tokens": 7}, PublishedWeights(1, "disk", {"path": "v1"}), 1.0)
    rec = train.on_step_done(done, num_train_cells=1)
    assert train.version == 1 and len(rec.groups) == 2 and train.ready_tokens() == 5
    versions[3] = -1  # sampled under a version the bound no longer allows at step 1
    train.add_group(group(3, 1))
    with pytest.raises(StalenessError):
        train.to_send()


@pytest.mark.parametrize(
    "num_unstarted,log,stops",
    [
        pytest.param(3, "x\n", False, id="fewer-than-the-first-step"),
        pytest.param(4, "starting\nbwrap: execvp /tmp/c/.venv/bin/mini: No such file\n\n", True, id="last-line"),
        pytest.param(4, None, True, id="no-log"),
    ],
)
def test_a_harness_that_never_starts_stops_the_run(tmp_path, num_unstarted, log, stops):
    path = tmp_path / "harness.log"
    if log is not None:
        path.write_text(log)
    if not stops:
        check_harness_started(num_unstarted, 4, "mini_swe_agent", path, "harness_failed")
        return
    with pytest.raises(HarnessStartError, match="harness.kind=mini_swe_agent: the first 4 executions") as e:
        check_harness_started(num_unstarted, 4, "mini_swe_agent", path, "harness_failed")
    assert str(e.value).endswith(" ends: bwrap: execvp /tmp/c/.venv/bin/mini: No such file" if log else "(empty)")


def test_held_out_versions_are_the_first_every_eval_every_steps_and_the_last():
    from gyre.errors import ConfigError
    from gyre.tasks.config import TasksConfig

    assert TasksConfig(eval_every=0).eval_versions(20) == {0, 20}
    assert TasksConfig(eval_every=10).eval_versions(20) == {0, 10, 20}
    assert TasksConfig(eval_every=7).eval_versions(20) == {0, 7, 14, 20}
    assert TasksConfig(eval_every=30).eval_versions(20) == {0, 20}
    with pytest.raises(ConfigError, match="eval_every"):
        TasksConfig(eval_every=-1)


def test_held_out_tasks_run_again_in_the_middle_of_a_run_at_each_eval_every(tmp_path):
    """tasks.eval_every=2 on 4 steps: the held-out set is queued under versions 0, 2 and 4 only, each
    once, ahead of the groups, and groups wait while it runs."""
    import hydra

    from gyre.common import CONF_DIR
    from gyre.config import register_configs, validate
    from gyre.coordinator.ledger import ExecutionLedger
    from gyre.coordinator.rollouts import Rollouts
    from gyre.tasks.taskset import toy_taskset

    register_configs()
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = validate(hydra.compose(config_name="config", overrides=["num_steps=4", "tasks.eval_every=2"]))
    events = SimpleNamespace(execution_state=lambda entry, step: None, held_out=lambda ex: None)
    ledger = ExecutionLedger(tmp_path / "ledger.jsonl")
    r = Rollouts(cfg, tmp_path, toy_taskset(), ledger, events)
    per_version = len(r.held_out_tasks) * cfg.tasks.eval_samples
    admitted = {}
    for version in range(5):
        r.admit_held_out(version)
        r.admit_held_out(version)  # once per version
        admitted[version] = [ex.held_out for ex in r.queue]
        r.admit_groups(version)
        if admitted[version]:  # the held-out executions run alone: no group joins the queue meanwhile
            assert all(ex.held_out == version for ex in r.queue)
        r.queue.clear()
    assert admitted == {v: [v] * per_version if v in (0, 2, 4) else [] for v in range(5)}
    ledger.close()


def test_a_turn_starts_executions_for_its_start_budget_and_leaves_the_rest_to_the_next(tmp_path, monkeypatch):
    """A step's burst of starts is spread over turns of the loop (coordinator.start_budget_s), so
    the loop collects and feeds training between them; a turn starts one at least, however small
    the budget."""
    import time

    import hydra

    import gyre.coordinator.rollouts as rollouts
    from gyre.common import CONF_DIR
    from gyre.config import register_configs, validate
    from gyre.tasks.taskset import toy_taskset

    start_s = 0.05

    class SlowSandbox:  # a start costing start_s (a sandbox's files, its harness's process)
        def __init__(self, *args):
            pass

        def prepare(self):
            time.sleep(start_s)

        def start(self):
            pass

    class Proxy:
        async def create_execution(self, execution_id):
            return {"records_path": str(tmp_path / execution_id), "api_key": "k"}

    monkeypatch.setattr(rollouts, "Sandbox", SlowSandbox)
    register_configs()
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = validate(
            hydra.compose(config_name="config", overrides=["tasks.eval_every=0", "coordinator.start_budget_s=0.12"])
        )
    ledger = ExecutionLedger(tmp_path / "ledger.jsonl")
    r = rollouts.Rollouts(cfg, tmp_path, toy_taskset(), ledger)
    r.attach(Proxy(), "http://127.0.0.1:1")
    r.queue.clear()  # no held-out rollouts: the groups alone
    r.admit_groups(0)
    queued = len(r.queue)
    asyncio.run(r.start_queued(free_slots=queued))
    first = len(r.running)
    assert 1 <= first <= 0.12 / start_s + 1 < queued  # within the budget, not the whole burst
    r.start_budget_s = 1e-9
    asyncio.run(r.start_queued(free_slots=queued))
    assert len(r.running) == first + 1 and len(r.queue) == queued - first - 1  # one at least
    ledger.close()
