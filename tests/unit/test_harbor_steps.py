"""Harbor multi-step tasks ([[steps]]): their fields read as Harbor 0.16.1 reads them (each step's
falling back to the task's), refusals naming the field, a step's view of its task, and the steps'
rewards: min_reward gating, the mean and final strategies, per-step metrics."""

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from gyre.harness.environment import LIFETIME_MARGIN_S, lifetime_s
from gyre.harness.evaluate import evaluate
from gyre.harness.sandbox import SandboxResult
from gyre.harness.steps import combine, ended, finish_step, stop_reason
from gyre.harness.task_checks import SandboxError
from gyre.tasks.harbor import load_harbor_task
from gyre.tasks.harbor_steps import STEP_VERIFIER_TIMEOUT_S
from gyre.tasks.spec import TaskSpecError, TaskStep, step_task
from gyre.trajectory.rewards import Evaluation

TWO_STEPS = """
[agent]
timeout_sec = 50
user = "agent"

[verifier]
timeout_sec = 20
env = { SHARED = "task", ONLY_TASK = "1" }
user = "checker"

[[steps]]
name = "write"
min_reward = 1.0

[[steps]]
name = "append"
min_reward = { reward = 0.5, style = 0.2 }
[steps.agent]
timeout_sec = 30
user = "second"
[steps.verifier]
timeout_sec = 5
env = { SHARED = "step" }
"""


def steps_dir(root: Path, toml: str = TWO_STEPS, files: dict | None = None, name: str = "two") -> Path:
    """A Harbor multi-step task folder: the task's tests/ and solution/, each step's instruction."""
    d = root / name
    base = {
        "task.toml": toml,
        "tests/test.sh": "echo 1 > /logs/verifier/reward.txt\n",
        "tests/helper.py": "",
        "solution/solve.sh": "true\n",
        "steps/write/instruction.md": "write a file",
        "steps/append/instruction.md": "append to it",
        "steps/append/tests/test.sh": "echo 0 > /logs/verifier/reward.txt\n",
        "steps/append/solution/solve.sh": "true\n",
    }
    for rel, text in {**base, **(files or {})}.items():
        if text is not None:
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_text(text)
    return d


def test_steps_are_read_with_the_tasks_fields_as_their_defaults(tmp_path):
    d = steps_dir(tmp_path)
    task = load_harbor_task(d)
    write, append = task.steps
    assert (write.name, write.instruction, append.instruction) == ("write", "write a file", "append to it")
    assert (write.time_budget_s, append.time_budget_s) == (50.0, 30.0)  # [agent].timeout_sec, else the step's
    # Harbor's step verifier table carries its own 600 s default: the task's 20 s is not the fallback
    assert (write.evaluator.timeout_s, append.evaluator.timeout_s) == (STEP_VERIFIER_TIMEOUT_S, 5.0)
    assert write.evaluator.env == {"SHARED": "task", "ONLY_TASK": "1"}
    assert append.evaluator.env == {"SHARED": "step", "ONLY_TASK": "1"}  # the step's over the task's
    assert write.evaluator.tests == (str(d / "tests"),)
    assert append.evaluator.tests == (str(d / "tests"), str(d / "steps/append/tests"))  # uploaded in order
    assert write.reference == {"solve_sh": str(d / "solution/solve.sh")}  # no solution of its own
    assert append.reference == {"solve_sh": str(d / "steps/append/solution/solve.sh")}
    assert (write.min_reward, append.min_reward) == ({"reward": 1.0}, {"reward": 0.5, "style": 0.2})
    assert (write.agent_user, append.agent_user, append.verifier_user) == (None, "second", None)
    assert task.step_reward == "mean"
    assert (task.instruction, task.time_budget_s) == ("write a file", 80.0)  # as listed: all the steps' budgets
    assert lifetime_s(task) == 50 + 600 + 30 + 5 + LIFETIME_MARGIN_S


def test_a_steps_view_is_a_task_of_one_step_with_its_fields(tmp_path):
    task = load_harbor_task(steps_dir(tmp_path))
    first, second = step_task(task, 0), step_task(task, 1)
    assert first.steps == second.steps == ()
    assert (first.instruction, first.time_budget_s, first.evaluator) == ("write a file", 50.0, task.steps[0].evaluator)
    assert (first.environment.agent_user, first.environment.verifier_user) == ("agent", "checker")  # the task's
    assert (second.environment.agent_user, second.environment.verifier_user) == ("second", "checker")
    assert second.reference == task.steps[1].reference
    assert first.environment.workdir == task.environment.workdir


def test_final_strategy_and_no_steps(tmp_path):
    task = load_harbor_task(steps_dir(tmp_path, 'multi_step_reward_strategy = "final"\n' + TWO_STEPS))
    assert task.step_reward == "final"
    single = tmp_path / "one"
    (single / "tests").mkdir(parents=True)
    (single / "task.toml").write_text("steps = []\n")  # Harbor: no steps is a task of one step
    (single / "instruction.md").write_text("do it")
    (single / "tests/test.sh").write_text("true")
    assert load_harbor_task(single).steps == ()


ONE = '[[steps]]\nname = "write"\n'
REFUSED = [  # (id, task.toml, files over the two-step folder's, the field named)
    ("strategy", 'multi_step_reward_strategy = "max"\n' + TWO_STEPS, {}, "multi_step_reward_strategy"),
    ("healthcheck", ONE + '[steps.healthcheck]\ncommand = "true"', {}, "steps[0].healthcheck"),
    ("artifacts", ONE + 'artifacts = ["/app/out"]', {}, "steps[0].artifacts"),
    ("agent-network", ONE + '[steps.agent]\nnetwork_mode = "public"', {}, "steps[0].agent.network_mode"),
    ("verifier-mode", ONE + '[steps.verifier]\nenvironment_mode = "shared"', {}, "steps[0].verifier.environment_mode"),
    ("collect", ONE + '[[steps.verifier.collect]]\ncommand = "true"', {}, "steps[0].verifier.collect"),
    ("workdir", TWO_STEPS, {"steps/write/workdir/setup.sh": "true"}, "steps/write/workdir"),
    ("no-instruction", TWO_STEPS, {"steps/append/instruction.md": " \n"}, "steps/append/instruction.md"),
    ("no-test-sh", ONE, {"tests/test.sh": None}, "steps/write/tests/test.sh"),
    ("bad-name", '[[steps]]\nname = "../up"', {}, "steps[0].name"),
    ("duplicate", ONE + ONE, {}, "steps"),
    ("min-reward", ONE + 'min_reward = "high"', {}, "steps[0].min_reward"),
    ("min-reward-key", ONE + "min_reward = { x = true }", {}, "steps[0].min_reward"),
    ("timeout", ONE + "[steps.agent]\ntimeout_sec = 0", {}, "steps[0].agent.timeout_sec"),
    ("step-user", ONE + "[steps.verifier]\nuser = [0]", {}, "steps[0].verifier.user"),
    ("step-env", ONE + "[steps.verifier]\nenv = { K = 1 }", {}, "steps[0].verifier.env"),
    ("steps-not-tables", "steps = [1]", {}, "steps[0]"),
]


@pytest.mark.parametrize("toml,files,field", [pytest.param(t, f, n, id=i) for i, t, f, n in REFUSED])
def test_what_gyre_cannot_run_is_refused_naming_the_field(toml, files, field, tmp_path):
    with pytest.raises(TaskSpecError) as e:
        load_harbor_task(steps_dir(tmp_path, toml, files))
    assert e.value.field_name == field, str(e.value)


def step(name: str = "s", min_reward: dict | None = None) -> TaskStep:
    return TaskStep(name, "do", 10.0, None, None, min_reward=min_reward)


def ev(score: float | None, outcome: str = "finished", **metrics) -> Evaluation:
    return Evaluation(outcome, score, f"reward {score}", metrics)


def test_a_step_below_its_min_reward_or_without_a_reward_stops_the_rest():
    assert stop_reason(step(), ev(0.0)) is None  # no min_reward: the next step runs whatever the reward
    assert stop_reason(step(min_reward={"reward": 0.5}), ev(0.5)) is None
    assert "reward=0.4 is below its min_reward 0.5" in stop_reason(step(min_reward={"reward": 0.5}), ev(0.4))
    gate = step(min_reward={"reward": 0.5, "style": 0.2})
    assert stop_reason(gate, ev(1.0, style=0.3)) is None
    assert "style=-inf" in stop_reason(gate, ev(1.0))  # a key the step lacks counts as -inf
    assert "has no reward" in stop_reason(step(), ev(None, "evaluator_error"))


def steps_task(tmp_path: Path, strategy: str = "mean"):
    toml = f'multi_step_reward_strategy = "{strategy}"\n' + TWO_STEPS
    return load_harbor_task(steps_dir(tmp_path, toml))


def test_mean_is_each_keys_mean_over_the_steps_that_ran_with_each_steps_rewards_kept(tmp_path):
    task = steps_task(tmp_path)
    done = [("write", ev(1.0, extra=4.0)), ("append", ev(0.5, style=0.6))]
    assert ended(task, done)
    got = combine(task, done)
    assert (got.outcome, got.score) == ("finished", 0.75)
    assert got.metrics == {
        "extra": 2.0,  # a key a step lacks counts 0
        "style": 0.3,
        "steps.write.reward": 1.0,
        "steps.write.extra": 4.0,
        "steps.append.reward": 0.5,
        "steps.append.style": 0.6,
    }
    assert got.detail.startswith("mean of 2 steps: write: reward 1.0; append: reward 0.5")


def test_final_is_the_last_steps_reward_and_a_gated_run_stops_early(tmp_path):
    task = steps_task(tmp_path, "final")
    assert combine(task, [("write", ev(1.0)), ("append", ev(0.25, style=0.5))]).score == 0.25
    stopped = [("write", ev(0.5))]  # the first step's min_reward is 1.0
    assert ended(task, stopped)
    got = combine(task, stopped)
    assert (got.outcome, got.score) == ("finished", 0.5)  # Harbor's final: the last step that ran
    assert "stopped: step 'write': reward=0.5 is below its min_reward 1" in got.detail
    assert combine(steps_task(tmp_path / "m"), stopped).score == 0.5  # mean over the one step that ran
    assert not ended(task, [("write", ev(1.0))])


def test_a_step_without_a_reward_ends_the_execution_with_its_outcome(tmp_path):
    task = steps_task(tmp_path)
    got = combine(task, [("write", ev(1.0)), ("append", ev(None, "evaluator_error"))])
    assert (got.outcome, got.score) == ("evaluator_error", None)
    assert got.detail.startswith("step 'append' has no reward")
    assert got.metrics == {"steps.write.reward": 1.0}


def test_a_timed_out_step_makes_the_execution_timed_out_kept_only_with_partial_credit(tmp_path):
    task = steps_task(tmp_path)
    kept = combine(task, [("write", ev(1.0, "timed_out")), ("append", ev(0.0))])
    assert (kept.outcome, kept.score) == ("timed_out", 0.5)
    dropped = combine(task, [("write", ev(0.0, "timed_out")), ("append", ev(0.0))])
    assert (dropped.outcome, dropped.score) == ("budget_exhausted", None)


def test_evaluating_a_multi_step_task_whole_is_a_caller_bug(tmp_path):
    task = steps_task(tmp_path)
    with pytest.raises(ValueError, match="has steps"):
        evaluate(task, tmp_path, "finished")


class FakeSandbox:
    """What finish_step drives: the task, its running step, the verified ones, and the next harness."""

    def __init__(self, task, fail_start: bool = False):
        self.task, self.step, self.steps_done, self.environment = task, 0, [], "env"
        self.fail_start, self.started = fail_start, []

    def next_step(self):
        if self.fail_start:
            raise SandboxError("harness 'x' is missing")
        self.step += 1
        self.started.append(self.step)


def scripted(monkeypatch, scores: list[float]) -> list:
    """Each step's verifier gives the next score; returns the (instruction, outcome) it was called with."""
    calls = []

    def fake_evaluate(task, workspace, outcome, environment):
        assert environment == "env" and not task.steps  # the step's view, in the execution's environment
        calls.append((task.instruction, outcome))
        return ev(scores[len(calls) - 1], outcome)

    monkeypatch.setattr("gyre.harness.steps.evaluate", fake_evaluate)
    return calls


def test_finish_step_verifies_the_step_then_starts_the_next_or_combines(tmp_path, monkeypatch):
    calls = scripted(monkeypatch, [1.0, 0.5])
    sb = FakeSandbox(steps_task(tmp_path))
    assert finish_step(sb, SandboxResult(0, True, 1.0, tmp_path, tmp_path / "log")) is None
    assert sb.started == [1]
    got = finish_step(sb, SandboxResult(0, False, 2.0, tmp_path, tmp_path / "log"))
    assert (got.outcome, got.score, sb.started) == ("timed_out", 0.75, [1])  # the first step ran out of time
    assert calls == [("write a file", "timed_out"), ("append to it", "finished")]


def test_finish_step_below_min_reward_starts_nothing_and_a_harness_that_cannot_start_is_an_error(tmp_path, monkeypatch):
    scripted(monkeypatch, [0.5])
    sb = FakeSandbox(steps_task(tmp_path))
    got = finish_step(sb, SandboxResult(0, False, 1.0, tmp_path, tmp_path / "log"))
    assert (got.outcome, got.score, sb.started) == ("finished", 0.5, [])
    scripted(monkeypatch, [1.0])
    broken = FakeSandbox(steps_task(tmp_path / "b"), fail_start=True)
    got = finish_step(broken, SandboxResult(0, False, 1.0, tmp_path, tmp_path / "log"))
    assert (got.outcome, got.score) == ("evaluator_error", None)
    assert got.detail == "step 'append': sandbox: harness 'x' is missing"


def test_the_coordinator_runs_a_multi_step_execution_until_its_last_step(tmp_path, monkeypatch):
    """A step's end puts its execution back among the running (its next step started, its key still
    valid); the last step's evaluation is the steps', ledgered with their metrics, the key revoked then."""
    import hydra

    from gyre.common import CONF_DIR
    from gyre.config import register_configs, validate
    from gyre.coordinator.ledger import ExecutionLedger, read_ledger
    from gyre.coordinator.rollouts import Rollouts
    from gyre.tasks.taskset import toy_taskset

    register_configs()
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = validate(hydra.compose(config_name="config", overrides=["num_steps=1", "tasks.eval_every=0"]))
    events = SimpleNamespace(execution_state=lambda entry, step: None, held_out=lambda ex: None)
    ledger = ExecutionLedger(tmp_path / "ledger.jsonl")
    r = Rollouts(cfg, tmp_path, toy_taskset(), ledger, events)
    r.admit_groups(0)
    ex = r.queue.pop(0)
    (tmp_path / "records.jsonl").write_text("{}\n")  # the harness made a model call
    result = SandboxResult(0, False, 1.0, tmp_path, tmp_path / "log")
    closed, revoked = [], []
    ex.sandbox = SimpleNamespace(task=steps_task(tmp_path / "t"), poll=lambda: result, close=lambda: closed.append(1))
    ex.records_path = tmp_path / "records.jsonl"

    async def revoke(execution_id):
        revoked.append(execution_id)

    r.proxy = SimpleNamespace(revoke_execution=revoke)
    answers = iter([None, Evaluation("finished", 0.75, "mean of 2 steps", {"steps.write.reward": 1.0})])
    monkeypatch.setattr("gyre.coordinator.rollouts.finish_step", lambda sandbox, ended: next(answers))
    r.running.append(ex)
    assert asyncio.run(r.collect()) == [] and r.running == [ex] and not revoked and not closed
    assert asyncio.run(r.collect()) == [ex] and r.running == [] and revoked == [ex.execution_id] and closed
    ledger.close()
    last = read_ledger(tmp_path / "ledger.jsonl").entries[ex.execution_id]
    assert (last.state, last.score, last.metrics) == ("finished", 0.75, {"steps.write.reward": 1.0})
