"""Harbor multi-step tasks (`[[steps]]`) read as Harbor 0.16.1 reads them (pure but for reading the folder).

    task.toml    multi_step_reward_strategy = "mean" | "final" (default mean)
                 [[steps]] name, [steps.agent] timeout_sec / user, [steps.verifier] timeout_sec / env /
                 user, min_reward (a number: the "reward" key; a table: key -> threshold)
    steps/<name>/instruction.md       the step's instruction (the task has no instruction.md of its own)
    steps/<name>/tests/               copied into /tests over the task's tests/; test.sh from either
    steps/<name>/solution/solve.sh    the step's oracle, else the task's solution/solve.sh

As harbor 0.16.1 reads them: src/harbor/models/task/config.py `StepConfig` / `TaskConfig` (fields
and defaults: a step's agent timeout and users fall back to the task's, its verifier timeout to
600 s), src/harbor/models/task/paths.py (the step folders), src/harbor/models/task/task.py
`_validate_tests` (each step needs its instruction.md and a test.sh, its own or the task's), and
src/harbor/verifier/verifier.py `verify` (a step's `[steps.verifier].env` over the task's).

Refused by name, Gyre does not run them: a step's own network policy (`network_mode`,
`allowed_hosts`), verifier environment (`environment_mode`, `environment`), `collect` hooks,
`healthcheck`, `artifacts`, and a step's `workdir/` folder (files put into the workdir and its
setup.sh run before the step).
"""

from dataclasses import replace
from pathlib import Path

from gyre.tasks.harbor_fields import parse_user, resolve_env
from gyre.tasks.spec import STEP_REWARDS, EvaluatorSpec, TaskSpecError, TaskStep

REFUSED = {
    "healthcheck": "a step's healthcheck is not run by Gyre",
    "artifacts": "a step's artifacts are not collected by Gyre",
    "agent.network_mode": "a step's own network policy is not run by Gyre (the task's applies)",
    "agent.allowed_hosts": "a step's own network policy is not run by Gyre (the task's applies)",
    "verifier.network_mode": "a step's own network policy is not run by Gyre (the task's applies)",
    "verifier.allowed_hosts": "a step's own network policy is not run by Gyre (the task's applies)",
    "verifier.environment_mode": "a step's own verifier environment is not run by Gyre (the task's applies)",
    "verifier.environment": "a step's own verifier environment is not run by Gyre (the task's applies)",
    "verifier.collect": "a step's collect hooks are not run by Gyre",
}
"""Step fields Gyre cannot honour, refused naming `steps[i].<field>`."""
STEP_VERIFIER_TIMEOUT_S = 600.0
"""A step's verifier timeout where the step sets none: Harbor's VerifierConfig default, not the task's
`[verifier].timeout_sec` (a step's verifier table always carries its own default in Harbor 0.16.1)."""


def parse_step_reward(cfg: dict, where: str) -> str:
    """`multi_step_reward_strategy`: how the steps' rewards make the trial's (Harbor's default: mean)."""
    strategy = cfg.get("multi_step_reward_strategy", "mean")
    if strategy not in STEP_REWARDS:
        raise TaskSpecError(where, "multi_step_reward_strategy", f"{strategy!r} is not one of mean, final")
    return strategy


def parse_min_reward(value, field: str, where: str) -> dict[str, float] | None:
    """`min_reward`: a number gates the "reward" key, a table each of its keys (Harbor's StepConfig)."""
    if value is None:
        return None
    table = {"reward": value} if not isinstance(value, dict) else value
    for threshold in table.values():
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise TaskSpecError(where, field, f"must be a number or a table of reward keys to numbers, got {value!r}")
    return {key: float(threshold) for key, threshold in table.items()}


def _table(step: dict, name: str, field: str, where: str) -> dict:
    value = step.get(name, {})
    if not isinstance(value, dict):
        raise TaskSpecError(where, f"{field}.{name}", "must be a table")
    return value


def _check_refused(step: dict, field: str, folder: Path, where: str) -> None:
    for key, why in REFUSED.items():
        table, _, name = key.rpartition(".")
        if name in (_table(step, table, field, where) if table else step):
            raise TaskSpecError(where, f"{field}.{key}", why)
    if (folder / "workdir").exists():
        raise TaskSpecError(
            where, f"steps/{folder.name}/workdir", "a step's workdir files and setup.sh are not run by Gyre"
        )


def _step_files(task_dir: Path, name: str, where: str) -> tuple[str, tuple[str, ...], Path]:
    """(the step's instruction, its tests folders in upload order, its solve.sh or the task's)."""
    folder = task_dir / "steps" / name
    md = folder / "instruction.md"
    instruction = md.read_text(errors="replace") if md.is_file() else ""
    if not instruction.strip():
        raise TaskSpecError(where, f"steps/{name}/instruction.md", "missing or empty")
    tests = tuple(str(d) for d in (task_dir / "tests", folder / "tests") if d.is_dir())
    if not any(Path(d, "test.sh").is_file() for d in tests):
        raise TaskSpecError(where, f"steps/{name}/tests/test.sh", "missing, and the task has no tests/test.sh")
    solve = folder / "solution" / "solve.sh"
    return instruction, tests, solve if solve.is_file() else task_dir / "solution" / "solve.sh"


def _parse_step(step, index: int, task_dir: Path, task_evaluator: EvaluatorSpec, agent_s: float, where: str):
    field = f"steps[{index}]"
    if not isinstance(step, dict):
        raise TaskSpecError(where, field, "must be a table ([[steps]])")
    name = step.get("name")
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_." for c in name) or name in (".", ".."):
        raise TaskSpecError(where, f"{field}.name", f"must be a folder name of letters, digits, - _ . (got {name!r})")
    _check_refused(step, field, task_dir / "steps" / name, where)
    agent, verifier = (_table(step, t, field, where) for t in ("agent", "verifier"))
    instruction, tests, solve = _step_files(task_dir, name, where)
    evaluator = replace(
        task_evaluator,
        timeout_s=_seconds(verifier, f"{field}.verifier.timeout_sec", STEP_VERIFIER_TIMEOUT_S, where),
        env={**task_evaluator.env, **resolve_env(verifier, f"{field}.verifier", where)},
        tests=tests,
    )
    return TaskStep(
        name=name,
        instruction=instruction,
        time_budget_s=_seconds(agent, f"{field}.agent.timeout_sec", agent_s, where),
        evaluator=evaluator,
        reference={"solve_sh": str(solve)} if solve.is_file() else None,
        agent_user=parse_user(agent, f"{field}.agent", where),
        verifier_user=parse_user(verifier, f"{field}.verifier", where),
        min_reward=parse_min_reward(step.get("min_reward"), f"{field}.min_reward", where),
    )


def _seconds(table: dict, field: str, default: float, where: str) -> float:
    value = table.get("timeout_sec", default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise TaskSpecError(where, field, f"must be a positive number, got {value!r}")
    return float(value)


def parse_steps(
    cfg: dict, task_dir: Path, task_evaluator: EvaluatorSpec, agent_s: float, where: str
) -> tuple[TaskStep, ...]:
    """The task's `[[steps]]` (empty: a task of one step, as Harbor's `has_steps`), each step's fields
    falling back to the task's: `task_evaluator` (its `[verifier]`) and `agent_s` (its agent budget).

    Raises:
        TaskSpecError: naming `steps[i].<field>` or the step's missing file.
    """
    steps = cfg.get("steps") or []
    if not isinstance(steps, list):
        raise TaskSpecError(where, "steps", "must be an array of tables ([[steps]])")
    parsed = tuple(_parse_step(s, i, task_dir, task_evaluator, agent_s, where) for i, s in enumerate(steps))
    names = [s.name for s in parsed]
    if dup := next((n for n in names if names.count(n) > 1), None):
        raise TaskSpecError(where, "steps", f"two steps are named {dup!r}")
    return parsed
