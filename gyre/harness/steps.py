"""Harbor multi-step tasks (`[[steps]]`, gyre/tasks/harbor_steps.py) run as Harbor 0.16.1 runs them
(src/harbor/trial/multi_step.py `MultiStepTrial`):

    in one environment, step after step   the step's agent: a fresh harness with the step's instruction,
                                          under the step's own budget (`_run_step_agent`, `_step_agent_timeout_sec`)
                                          then the step's verifier, in that environment (shared mode:
                                          `_run_step_verifier`), a fresh /tests and /logs/verifier
    the steps after one do not run        when its rewards are below its `min_reward` (a key it lacks
                                          counts as -inf), or it has no reward (`_should_stop_after_step`)
    the execution's reward                mean: each reward key's mean over the steps that ran, a key a
                                          step lacks counting 0; final: the last step's (`_select_multi_step_reward`)

Each step's harness starts afresh, as Harbor's agents do: `agent.run` is called once per step, and
its agents open a new conversation each time (terminus_2 `run` makes a new Chat; claude_code and
codex run a new `claude --print` / `codex exec`); only the environment carries over.

Where Gyre's rules differ: a step's rewards are its verifier's reward under "reward" and reward.json's
other keys (a reward.json of one key not named "reward" is keyed "reward" here); a step without a
reward (its verifier failed, or it stopped at its budget without partial credit) ends the execution
with that step's outcome (evaluator_error or budget_exhausted: excluded, never scored), where Harbor
scores the steps before it. Each step's rewards are kept as named metrics, `steps.<name>.<key>`.
"""

import math
from pathlib import Path

from gyre.errors import GyreError
from gyre.harness.environment import open_environment
from gyre.harness.evaluate import evaluate
from gyre.harness.sandbox import Sandbox, SandboxResult
from gyre.harness.workspace import WorkspaceError, solve_in
from gyre.tasks.spec import Task, TaskStep, step_task
from gyre.trajectory.rewards import Evaluation, settle_budget


def rewards_of(evaluation: Evaluation) -> dict[str, float]:
    """A verified step's rewards as Harbor keys them: its reward as "reward", reward.json's other keys."""
    return {"reward": evaluation.score, **evaluation.metrics}


def stop_reason(step: TaskStep, evaluation: Evaluation) -> str | None:
    """Why the steps after `step` do not run (harbor `_should_stop_after_step`, `_min_reward_failure`):
    it has no reward, or a reward below its `min_reward` (a key it lacks: -inf); None: they run."""
    if evaluation.score is None:
        return f"step {step.name!r} has no reward"
    rewards = rewards_of(evaluation)
    for key, threshold in (step.min_reward or {}).items():
        actual = rewards.get(key, -math.inf)
        if actual < threshold:
            return f"step {step.name!r}: {key}={actual:g} is below its min_reward {threshold:g}"
    return None


def ended(task: Task, done: list[tuple[str, Evaluation]]) -> bool:
    """Whether no step runs after those `done`: the last one ran, or the latest stops the rest."""
    return len(done) == len(task.steps) or stop_reason(task.steps[len(done) - 1], done[-1][1]) is not None


def combine(task: Task, done: list[tuple[str, Evaluation]]) -> Evaluation:
    """The execution's Evaluation from its steps' (those that ran, in order), by the task's
    `multi_step_reward_strategy` (harbor `_select_multi_step_reward`, `_aggregate_step_rewards`); a
    timed-out step makes it timed_out (kept only with partial credit, settle_budget)."""
    name, last = done[-1]
    details = "; ".join(f"{n}: {ev.detail}" for n, ev in done)
    per_step = {
        f"steps.{n}.{key}": value for n, ev in done if ev.score is not None for key, value in rewards_of(ev).items()
    }
    if last.score is None:
        return Evaluation(last.outcome, None, f"step {name!r} has no reward: {details}", per_step)
    if task.step_reward == "final":
        rewards = rewards_of(last)
    else:
        keys = {key for _, ev in done for key in rewards_of(ev)}
        rewards = {key: sum(rewards_of(ev).get(key, 0.0) for _, ev in done) / len(done) for key in keys}
    if len(done) < len(task.steps):
        details += f"; stopped: {stop_reason(task.steps[len(done) - 1], last)}"
    outcome = "timed_out" if any(ev.outcome == "timed_out" for _, ev in done) else "finished"
    score = rewards.pop("reward")
    return settle_budget(
        Evaluation(outcome, score, f"{task.step_reward} of {len(done)} steps: {details}", rewards | per_step)
    )


def finish_step(sandbox: Sandbox, result: SandboxResult) -> Evaluation | None:
    """After a step's harness ended (`result`): verify the step in its environment, then start the next
    step's harness (None) or return the execution's Evaluation (`combine`). A next step whose harness
    cannot start ends the execution as an evaluator_error (blocking: run it in a worker thread)."""
    task, index = sandbox.task, sandbox.step
    outcome = "timed_out" if result.timed_out else "finished"
    sandbox.steps_done.append(
        (task.steps[index].name, evaluate(step_task(task, index), result.workspace, outcome, sandbox.environment))
    )
    if ended(task, sandbox.steps_done):
        return combine(task, sandbox.steps_done)
    try:
        sandbox.next_step()
    except (GyreError, OSError) as e:
        return Evaluation("evaluator_error", None, f"step {task.steps[index + 1].name!r}: sandbox: {e}")
    return None


def wait_steps(sandbox: Sandbox) -> tuple[SandboxResult, Evaluation | None]:
    """Wait for the harness to end, and for a multi-step task for each step's in turn (`finish_step`):
    (the last harness's result, the steps' Evaluation; None for a task of one step)."""
    while True:
        result = sandbox.wait()
        if not sandbox.task.steps:
            return result, None
        if (evaluation := finish_step(sandbox, result)) is not None:
            return result, evaluation


def check_steps(task: Task, workspace: Path, oracle: bool) -> Evaluation:
    """A multi-step task's steps without a harness (gyre-task check), in one environment: each step's
    oracle (its solution/solve.sh, else the task's, as harbor src/harbor/agents/oracle.py picks it; or
    nothing, for the untouched workspace), then its verifier, gated as a run is; their Evaluation.

    Raises:
        GyreError: the environment cannot start, or a step has no oracle to run.
    """
    env = open_environment(task, workspace, task.environment.agent_network)
    done: list[tuple[str, Evaluation]] = []
    try:
        while not done or not ended(task, done):
            view = step_task(task, len(done))
            if oracle and view.reference is None:
                raise WorkspaceError(f"task {task.task_id!r}: step {task.steps[len(done)].name!r} has no solve.sh")
            if oracle:
                solve_in(env, view)
            done.append((task.steps[len(done)].name, evaluate(view, workspace, "finished", env)))
    finally:
        env.close()
    return combine(task, done)
