"""Evaluators: score a finished (or timed-out, preserved) workspace into an `Evaluation`.

Kinds: `pytest` (pass fraction from a junit XML report; a test module that cannot be collected,
because it imports what the agent did not write, counts as a failed test), `json_score` (a command
whose last stdout line is a JSON number or {"score": x}), `files` (fraction of expected files with
equal content), `harbor` (Harbor's verifier contract, below).
Anything that says nothing about the policy, an evaluator that crashes, hangs past its own timeout,
prints garbage or finds its own files gone, is `evaluator_error` (the execution is excluded, never
scored 0). A file the harness should have written and did not is a real 0 for a finished run; a run
stopped at its time budget keeps only partial credit, a score above 0, and is otherwise
`budget_exhausted` (gyre.trajectory.rewards.settle_budget: discarded, as the seed prescribes).

Harbor verifier: after the agent ends, in the agent's own environment (Harbor's shared mode,
gyre/harness/environment.py: what the agent installed, wrote outside the workdir or left running is
there) or, with `[verifier].environment_mode = "separate"`, in a fresh one with only the workspace:
a fresh copy of the task's tests/ at /tests (a step's: its tests/ over the task's, gyre/harness/steps.py),
an emptied /logs/verifier; `bash /tests/test.sh` runs in the workdir under `[verifier].timeout_sec`,
its exit status ignored as Harbor does.
The reward is read as Harbor reads it (`parse_reward`): reward.txt first, else reward.json's
"reward" (or only) key; reward.json's other numbers become the evaluation's named metrics; any
finite number is kept. No reward file, garbage or a timeout: evaluator_error.
"""

import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from gyre.common import jsonio
from gyre.harness.environment import BaseTaskEnv, TaskEnvError, open_environment
from gyre.harness.podman import PodmanError
from gyre.tasks.spec import EvaluatorSpec, Task
from gyre.trajectory.rewards import HARNESS_OUTCOMES, Evaluation, settle_budget

PYTEST_FLAGS = "-p no:cacheprovider --continue-on-collection-errors"
"""Added to a pytest evaluator's command: a module that cannot be collected no longer stops the others."""
PYTEST_SCORED_EXITS = (0, 1)
"""pytest exit codes whose report is scored: all passed, or some failed (collection errors included)."""


class EvaluatorFailed(Exception):
    """The evaluator itself failed (internal: becomes an evaluator_error Evaluation)."""


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    stdout: str
    stderr: str


def make_command(template: str, workspace: Path) -> str:
    """The evaluator's shell command with {python}, {workspace} and {pkg} filled in."""
    return template.format(python=sys.executable, workspace=str(workspace), pkg=str(resources.files("gyre")))


def run_command(
    command: str | list[str], workspace: Path, timeout_s: float, env: dict[str, str] | None = None
) -> CommandResult:
    """Run `command` (a shell line, or an argv) in its own process group; on timeout kill the whole group.

    Raises:
        EvaluatorFailed: it ran past `timeout_s`.
    """
    proc = subprocess.Popen(
        command,
        shell=isinstance(command, str),
        cwd=workspace,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})},
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise EvaluatorFailed(f"evaluator ran past its timeout of {timeout_s} s") from None
    return CommandResult(proc.returncode, out, err)


def parse_json_score(stdout: str) -> float:
    """The score on the last non-empty stdout line: a JSON number or an object with `score`.

    Raises:
        EvaluatorFailed: no such line, not JSON, or not a number in [0, 1].
    """
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise EvaluatorFailed("evaluator printed nothing (expected a JSON score on its last line)")
    try:
        value = jsonio.loads(lines[-1])
    except jsonio.DecodeError:
        raise EvaluatorFailed(f"last line is not JSON: {lines[-1][:200]!r}") from None
    score = value.get("score") if isinstance(value, dict) else value
    if not isinstance(score, (int, float)) or isinstance(score, bool) or not 0.0 <= score <= 1.0:
        raise EvaluatorFailed(f"score must be a number in [0, 1], got {score!r}")
    return float(score)


def parse_junit_fraction(xml_text: str) -> tuple[float, str]:
    """(passed / run, summary) from a junit XML report (skipped tests do not count).

    A test module that could not be collected (it imports what the agent did not write, or wrote
    broken) is one errored test in the report, so it counts as one failed test, as SWE-bench and
    Harbor verifiers count tests that did not pass.

    Raises:
        EvaluatorFailed: unreadable report, or no test ran.
    """
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as e:
        raise EvaluatorFailed(f"junit report is not XML ({e})") from None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    ran = counts["tests"] - counts["skipped"]
    if ran <= 0:
        raise EvaluatorFailed("no test ran")
    passed = ran - counts["failures"] - counts["errors"]
    uncollected = sum(1 for s in suites for e in s.iter("error") if e.get("message") == "collection failure")
    note = f" ({uncollected} uncollectable module{'s' * (uncollected > 1)} counted as failed)" if uncollected else ""
    return passed / ran, f"{passed}/{ran} tests passed{note}"


def score_pytest_report(exit_code: int, xml_text: str | None) -> tuple[float, str]:
    """The pass fraction of a pytest run (run with PYTEST_FLAGS) from its exit code and junit report.

    Exits 0 and 1 are scored, collection errors counted as failed tests. The rest are failures the
    policy cannot cause: 2 (interrupted: with --continue-on-collection-errors never by a collection
    error, so a KeyboardInterrupt or pytest.exit), 3 (pytest's internal error), 4 (usage error: a bad
    option, a test path gone) and 5 (no test collected: the task's selection holds no test, whereas
    a module the agent was to write shows as a collection error).

    Raises:
        EvaluatorFailed: any exit but 0 and 1, no report, or a report with no test run.
    """
    if exit_code not in PYTEST_SCORED_EXITS:
        raise EvaluatorFailed(f"pytest exited {exit_code} (tests did not run)")
    if xml_text is None:
        raise EvaluatorFailed("pytest wrote no junit report")
    return parse_junit_fraction(xml_text)


def score_files(spec: EvaluatorSpec, workspace: Path) -> tuple[float, str]:
    """Fraction of expected files whose content equals (trailing whitespace ignored)."""
    equal = [
        rel
        for rel, text in spec.files.items()
        if (workspace / rel).is_file() and (workspace / rel).read_text(errors="replace").rstrip() == text.rstrip()
    ]
    return len(equal) / len(spec.files), f"{len(equal)}/{len(spec.files)} files match"


def _read_optional(path: Path) -> str | None:
    return path.read_text(errors="replace") if path.is_file() else None


def _score_pytest(spec: EvaluatorSpec, workspace: Path) -> tuple[float, str]:
    with tempfile.TemporaryDirectory(prefix="gyre-junit-") as tmp:
        report = Path(tmp) / "report.xml"
        cmd = f"{make_command(spec.command, workspace)} {PYTEST_FLAGS} --junitxml={report}"
        done = run_command(cmd, workspace, spec.timeout_s)
        try:
            return score_pytest_report(done.exit_code, _read_optional(report))
        except EvaluatorFailed as e:
            raise EvaluatorFailed(f"{e}: {(done.stdout + done.stderr)[-300:]}") from None


def _score_json(spec: EvaluatorSpec, workspace: Path) -> tuple[float, str]:
    done = run_command(make_command(spec.command, workspace), workspace, spec.timeout_s)
    if done.exit_code != 0:
        raise EvaluatorFailed(f"evaluator exited {done.exit_code}: {done.stderr.strip()[-300:]}")
    return parse_json_score(done.stdout), ""


def _reward_number(value, where: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise EvaluatorFailed(f"{where} must be a finite number, got {value!r}")
    return float(value)


def parse_reward(txt: str | None, json_text: str | None) -> tuple[float, dict[str, float]]:
    """(the reward, the other named numbers) from the texts of reward.txt and reward.json (None: no file).

    As Harbor reads them (harbor 0.16.1 src/harbor/verifier/verifier.py `verify`: reward.json when it
    exists, else reward.txt): reward.json, when there, decides and reward.txt is not read; its scalar is
    its "reward" key, else its only key (harbor src/harbor/upload/uploader.py `_extract_primary_reward`;
    several keys without "reward" have none), and its other numeric keys are kept as named metrics.
    Any finite number is kept, in [0, 1] or not.

    Raises:
        EvaluatorFailed: no file, garbage, or a reward.json with several keys and no "reward".
    """
    if json_text is None:
        if txt is None:
            raise EvaluatorFailed("the verifier wrote no reward file (/logs/verifier/reward.txt or reward.json)")
        try:
            value = float(txt.strip())
        except ValueError:
            raise EvaluatorFailed(f"reward.txt is not one number: {txt[:200]!r}") from None
        return _reward_number(value, "reward.txt"), {}
    try:
        obj = jsonio.loads(json_text)
    except jsonio.DecodeError:
        raise EvaluatorFailed(f"reward.json is not JSON: {json_text[:200]!r}") from None
    if not isinstance(obj, dict):
        raise EvaluatorFailed(f"reward.json must be an object of names to numbers, got {type(obj).__name__}")
    if "reward" not in obj and len(obj) != 1:
        raise EvaluatorFailed(f'reward.json needs a "reward" key or exactly one key, got {sorted(obj)}')
    key = "reward" if "reward" in obj else next(iter(obj))
    value = _reward_number(obj[key], f"reward.json's {key!r}")
    metrics = {
        k: float(v)
        for k, v in obj.items()
        if k != key and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
    return value, metrics


def verify_in(env: BaseTaskEnv, task: Task) -> tuple[float, str, dict[str, float]]:
    """Run the verifier in `env` (its task's workdir): a fresh /tests (the evaluator's `tests` folders,
    a step's over its task's), an empty /logs/verifier, then
    `bash /tests/test.sh` as `[verifier].user` with `[environment].env` and `[verifier].env`, its exit
    status logged, not scored (Harbor). Past its timeout, what it started inside is killed."""
    contract = task.environment
    env.clear_verifier_logs()
    env.put("/tests", *map(Path, task.evaluator.tests))
    variables = {**contract.env, **task.evaluator.env}
    host_env = {"HOME": str(env.home)} if env.backend == "bwrap" else {}
    argv = env.enter(["bash", "/tests/test.sh"], variables, contract.verifier_user)
    try:
        done = run_command(argv, env.workspace, task.evaluator.timeout_s, host_env)
    except EvaluatorFailed:
        env.kill_all()
        raise
    logs = env.verifier_logs
    try:
        score, metrics = parse_reward(_read_optional(logs / "reward.txt"), _read_optional(logs / "reward.json"))
    except EvaluatorFailed as e:
        tail = (done.stdout + done.stderr)[-300:]
        raise EvaluatorFailed(f"{e} (test.sh exited {done.exit_code}: {tail})") from None
    detail = f"reward {score:g} (test.sh exited {done.exit_code})"
    if task.evaluator.clip_reward and not 0.0 <= score <= 1.0:
        score, detail = min(1.0, max(0.0, score)), f"{detail}, clipped to {min(1.0, max(0.0, score)):g}"
    return score, detail, metrics


def score_harbor(task: Task, workspace: Path, shared: BaseTaskEnv | None = None) -> tuple[float, str, dict]:
    """Verify `workspace` as Harbor's contract says: in `shared`, the agent's own environment, when the
    task verifies in shared mode (Harbor's default) and one is given; else in a fresh environment made
    for the verifier alone (separate mode, or a workspace no agent ran in), ended afterwards."""
    if shared is not None and task.environment.verification == "shared":
        return verify_in(shared, task)
    try:
        env = open_environment(task, workspace, task.environment.verifier_network)
    except (PodmanError, TaskEnvError) as e:
        raise EvaluatorFailed(str(e)) from None
    try:
        return verify_in(env, task)
    finally:
        env.close()


SCORERS = {"pytest": _score_pytest, "json_score": _score_json, "files": score_files}


def evaluate(task: Task, workspace: Path, outcome: str, environment: BaseTaskEnv | None = None) -> Evaluation:
    """Score `workspace` for `task` after the harness ended with `outcome` (finished / timed_out);
    a Harbor task in `environment`, the one its agent ran in (Sandbox.environment; its owner ends it).

    Never raises for evaluator trouble: that is an `evaluator_error` Evaluation with the reason
    in `detail` (and the seconds the evaluator took). A run stopped at its time budget
    (`timed_out`) without partial credit, its evaluator failed or its score 0, is
    `budget_exhausted`: it ran out of time without a valid reward and is discarded, counted apart
    from an evaluator failing on a finished one (the seed's rule, settle_budget).

    Raises:
        ValueError: `outcome` is not a harness outcome, or the task has steps (a caller bug).
    """
    if outcome not in HARNESS_OUTCOMES:
        raise ValueError(f"outcome must be one of {', '.join(HARNESS_OUTCOMES)}, got {outcome!r}")
    if task.steps:
        raise ValueError(f"task {task.task_id!r} has steps: each is evaluated on its own (gyre/harness/steps.py)")
    start = time.monotonic()
    workspace = Path(workspace)
    try:
        if not workspace.is_dir():
            raise EvaluatorFailed(f"workspace {workspace} is missing")
        metrics = {}
        if task.evaluator.kind == "harbor":
            score, detail, metrics = score_harbor(task, workspace, environment)
        else:
            score, detail = SCORERS[task.evaluator.kind](task.evaluator, workspace)
    except (EvaluatorFailed, OSError, UnicodeError) as e:
        failed = "evaluator_error" if outcome == "finished" else outcome  # timed out: budget_exhausted
        return settle_budget(Evaluation(failed, None, f"{e} ({time.monotonic() - start:.2f} s)"))
    return settle_budget(Evaluation(outcome, score, f"{detail} ({time.monotonic() - start:.2f} s)".lstrip(), metrics))
