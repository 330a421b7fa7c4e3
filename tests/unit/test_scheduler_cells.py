"""Cell state machine phases, the staleness rule and the streaming micro-step queue."""

import pytest

from gyre.scheduler.cells import PHASES, Cell, Phase, Role, SchedulerError, TransitionError, make_cells
from gyre.scheduler.streaming import MicroStepQueue, StalenessError, check_staleness, may_admit, trained_spans


def _walk(cell: Cell, target: Role, now: float = 1.0) -> list[Phase]:
    seen = [cell.begin_switch(target, now)]
    while (p := cell.next_phase(now)) is not None:
        seen.append(p)
    return seen


@pytest.mark.parametrize(
    "start, target, phases",
    [
        pytest.param(Role.ROLLOUT, Role.TRAIN, PHASES[Role.TO_TRAIN], id="rollout-to-train"),
        pytest.param(Role.TRAIN, Role.ROLLOUT, PHASES[Role.TO_ROLLOUT], id="train-to-rollout"),
    ],
)
def test_switch_walks_every_phase_in_order(start, target, phases):
    cell = Cell(index=1, num_nodes=48, role=start)
    assert _walk(cell, target) == list(phases)
    assert cell.role == target and cell.phase is None and cell.since_s == 1.0


def test_rollout_to_train_phases_are_the_issue_s():
    assert PHASES[Role.TO_TRAIN] == (
        Phase.STOP_ADMISSION,
        Phase.HAND_OFF_SESSIONS,
        Phase.RELEASE_ENGINE_MEMORY,
        Phase.ONLOAD_TRAINER,
        Phase.PULL_WEIGHTS,
        Phase.JOIN_STEP,
    )
    assert PHASES[Role.TO_ROLLOUT] == (
        Phase.FINISH_MICROSTEP,
        Phase.OFFLOAD_TRAINER,
        Phase.LOAD_WEIGHTS,
        Phase.ANNOUNCE_TO_PROXY,
    )


@pytest.mark.parametrize(
    "role, target, core_step, match",
    [
        pytest.param(Role.ROLLOUT, Role.ROLLOUT, None, "rollout -> rollout", id="already-there"),
        pytest.param(Role.TO_TRAIN, Role.ROLLOUT, None, "to_train -> rollout", id="mid-switch"),
        pytest.param(Role.LOST, Role.TRAIN, None, "lost -> train", id="lost-cell"),
        pytest.param(Role.TRAIN, Role.ROLLOUT, 3, "part of step 3", id="core-in-step"),
    ],
)
def test_forbidden_transitions_raise(role, target, core_step, match):
    cell = Cell(index=0, num_nodes=1, is_core=True, role=role, step=core_step)
    with pytest.raises(TransitionError, match=match):
        cell.begin_switch(target, 0.0)
    assert cell.role == role  # unchanged


def test_core_may_leave_once_its_step_is_applied_and_a_lost_cell_stays_lost():
    core = make_cells(2, 4)[0]
    core.role = Role.TRAIN
    core.join_step(0)
    with pytest.raises(TransitionError):
        core.begin_switch(Role.ROLLOUT, 1.0)
    core.leave_step()
    assert core.begin_switch(Role.ROLLOUT, 2.0) == Phase.FINISH_MICROSTEP
    core.lose(3.0)
    assert core.role == Role.LOST and core.step is None
    with pytest.raises(TransitionError):
        core.next_phase(4.0)


@pytest.mark.parametrize(
    "step, version, s, ok",
    [
        pytest.param(0, 0, 0, True, id="on-policy-current"),
        pytest.param(1, 0, 0, False, id="on-policy-next-waits"),
        pytest.param(1, 0, 1, True, id="one-ahead-allowed"),
        pytest.param(2, 0, 1, False, id="two-ahead-refused"),
        pytest.param(5, 3, 2, True, id="at-the-bound"),
    ],
)
def test_admission_and_training_obey_the_same_bound(step, version, s, ok):
    assert may_admit(step, version, s) is ok
    if ok:
        check_staleness(version, step, s)
    else:
        with pytest.raises(StalenessError, match="staleness bound"):
            check_staleness(version, step, s)


def test_queue_streams_only_the_current_step_and_applies_one_optimizer_step():
    q = MicroStepQueue(groups_per_step=2, staleness=1)
    q.add_ready(1, 0, start_version=0, tokens=10)  # next step's group is ready early: not claimable
    assert q.claim() is None
    q.add_ready(0, 0, start_version=0, tokens=5)
    assert not q.batch_ready()
    a = q.claim()
    assert (a.step, a.group_id) == (0, 0) and q.step_started()
    q.hand_back(a)  # a leaving cell returns it: claimed again first
    assert q.claim() == a
    q.exclude(0, 1)  # the other group had no valid reward
    assert q.batch_ready() and not q.step_complete()
    with pytest.raises(SchedulerError, match="not complete"):
        q.apply_optimizer_step()
    q.complete(a)
    assert q.step_complete() and q.apply_optimizer_step() == 1
    assert q.claim().step == 1 and q.max_lag == 1


def test_queue_refuses_a_sample_over_the_bound_and_extra_groups():
    q = MicroStepQueue(groups_per_step=1, staleness=0)
    q.add_ready(0, 0, start_version=0, tokens=1)
    q.complete(q.claim())
    q.apply_optimizer_step()
    q.add_ready(1, 1, start_version=0, tokens=1)  # admitted under version 0 for step 1: a caller bug
    with pytest.raises(StalenessError):
        q.claim()
    with pytest.raises(SchedulerError, match="more than 1 groups"):
        q.exclude(1, 2)


def test_first_ready_groups_fill_the_earliest_open_step():
    q = MicroStepQueue(groups_per_step=2, staleness=1)
    assert q.open_step() == 0
    q.add_ready(q.open_step(), 5, 0, 100)
    q.exclude(q.open_step(), 6)
    assert q.open_step() == 1 and q.batch_ready()  # step 0 is full: later groups go to step 1
    q.add_ready(q.open_step(), 0, 0, 40)
    assert q.ready_tokens() == 100 and q.ready_tokens_ahead() == 40
    q.complete(q.claim())
    q.apply_optimizer_step()
    assert q.open_step() == 1 and q.ready_tokens() == 40 and q.ready_tokens_ahead() == 0


@pytest.mark.parametrize(
    "marks, spans, step, s, expected",
    [
        pytest.param([(0, 0)], 5, 1, 1, (0, 0), id="inside-the-bound: every span trains"),
        pytest.param([(0, 0), (2, 3)], 5, 3, 1, (3, 2), id="old-spans-masked"),
        pytest.param([(0, 0), (1, 2)], 5, 4, 1, None, id="every-span-too-old: dropped"),
        pytest.param([(0, 0), (3, 5)], 5, 3, 0, None, id="last-version-opened-after-the-last-span"),
    ],
)
def test_per_span_rule(marks, spans, step, s, expected):
    assert trained_spans(marks, spans, step, s) == expected
