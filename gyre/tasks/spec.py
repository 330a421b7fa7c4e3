"""Task specs (pure but for reading them): what an execution works on and how it is scored.

Gyre's own specs are a directory of `*.json` files (one task each) or a JSONL file (one task per
line); gyre/tasks/harbor.py reads Harbor task folders into the same `Task`, and gyre/tasks/taskset.py
chooses between the two. Relative paths in a spec (workspace sources, tarballs) are relative to the set's directory;
`pkg:<path>` names a file shipped inside the `gyre` package (the embedded toy set).
Every error names the task id (or the line) and the field.

    {"task_id": "...", "instruction": "...", "workspace": {"dir": "ws"} | {"git": URL, "commit": SHA}
     | {"tar": "ws.tar.gz"} | {"files": {"name": "text"}}, "setup": "shell command" | null,
     "evaluator": {"kind": "pytest" | "json_score" | "files", ...}, "time_budget_s": 60,
     "reference": {"files": {...}} | {"command": "..."} | null}
"""

from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from gyre.common import jsonio
from gyre.errors import GyreError

EVALUATOR_KINDS = ("pytest", "json_score", "files")
WORKSPACE_KINDS = ("dir", "git", "tar", "files")


class TaskSpecError(GyreError, ValueError):
    """A task spec that cannot run; names the task (or line) and the field."""

    def __init__(self, where: str, field_name: str, message: str):
        self.where, self.field_name = where, field_name
        super().__init__(f"{where}: {field_name}: {message}")


@dataclass(frozen=True)
class WorkspaceSource:
    """Where a fresh workspace copy comes from: one of WORKSPACE_KINDS."""

    kind: str
    location: str = ""
    """Directory, repository URL/path or tarball (absolute after loading); empty for `files`."""
    commit: str = ""
    """For `git`: the commit checked out."""
    files: dict[str, str] = field(default_factory=dict)
    """For `files`: relative path -> content, written into an empty workspace."""


@dataclass(frozen=True)
class EvaluatorSpec:
    """How a finished workspace is scored: pytest pass fraction, a script's JSON score, or exact files."""

    kind: str
    command: str = ""
    """pytest / json_score: a shell command run in the workspace; `{python}` is this interpreter,
    `{workspace}` the workspace, `{pkg}` the installed gyre package directory."""
    files: dict[str, str] = field(default_factory=dict)
    """files: relative path -> expected content (score = fraction equal, trailing whitespace ignored)."""
    timeout_s: float = 60.0
    """The evaluator's own time limit; past it the evaluation is an evaluator error."""
    env: dict[str, str] = field(default_factory=dict)
    """harbor: `[verifier].env`, added to the verifier's environment."""
    clip_reward: bool = False
    """harbor: clip the verifier's reward to [0, 1] (`tasks.clip_reward`); else kept as written."""
    tests: tuple[str, ...] = ()
    """harbor: the folders copied into /tests, in order (a step's tests/ over the task's, as Harbor 0.16.1
    src/harbor/verifier/verifier.py `_resolve_tests` uploads them)."""


@dataclass(frozen=True)
class TaskEnvironment:
    """A Harbor task's container contract: the paths the agent and the verifier see, and the limits.

    The agent works in `workdir`; after it ends the verifier gets `tests/` at /tests and an empty
    /logs/verifier. Tasks of Gyre's own JSON specs have none (the workspace at its host path)."""

    task_dir: str
    """The Harbor task folder (absolute): tests/ and solution/ are read from it, never shown to the agent."""
    workdir: str = "/app"
    """Where the workspace appears inside the sandbox (the agent's and the verifier's cwd); empty: the
    image's WORKDIR (`[environment].workdir` unset on a task with an image, gyre/harness/podman.py)."""
    docker_image: str = ""
    """`[environment].docker_image`; empty: none."""
    dockerfile: str = ""
    """`environment/Dockerfile` (absolute) if the folder has one; empty: none."""
    cpus: float | None = None
    """`[environment].cpus`; None: the harness's defaults."""
    memory_mb: int | None = None
    """`[environment].memory_mb` (or `memory` = "4G"); caps the sandbox's RLIMIT_AS."""
    storage_mb: int | None = None
    """`[environment].storage_mb`: read, not enforced (no disk quota in either sandbox; logged)."""
    build_timeout_s: float = 600.0
    """`[environment].build_timeout_sec`: how long pulling or building the task's image may take."""
    gpus: int = 0
    """`[environment].gpus`; a task that needs any is refused where the sandbox has none."""
    env: dict[str, str] = field(default_factory=dict)
    """`[environment].env` (templates resolved from the host): set in every phase."""
    solution_env: dict[str, str] = field(default_factory=dict)
    """`[solution].env`: added for the oracle (solution/solve.sh)."""
    agent_user: str | None = None
    """`[agent].user` (name or uid) the agent and the oracle run as; None: the environment's default."""
    verifier_user: str | None = None
    """`[verifier].user` the verifier runs as; None: the environment's default."""
    agent_network: str = "public"
    """The agent's network, "public" | "none" (`network_mode` / `allow_internet`, gyre/tasks/harbor_fields.py)."""
    agent_network_asked: bool = False
    """The task named the agent's network mode itself (a site that allows none refuses it if public)."""
    verifier_network: str = "public"
    """The verifier's network, "public" | "none"."""
    verifier_network_asked: bool = False
    """The task named the verifier's network mode itself (shared verification cannot change it)."""
    verification: str = "shared"
    """`[verifier].environment_mode`: shared (in the agent's environment, after it) or separate (a fresh one)."""

    @property
    def image(self) -> str:
        """What the task must start from when not from its environment/ files: an image or a Dockerfile."""
        return self.docker_image or self.dockerfile


STEP_REWARDS = ("mean", "final")
"""Harbor's `multi_step_reward_strategy` (harbor 0.16.1 src/harbor/models/task/config.py)."""


@dataclass(frozen=True)
class TaskStep:
    """One step of a Harbor multi-step task (`[[steps]]`, gyre/tasks/harbor_steps.py): what differs
    from the task's own fields while the step runs (`step_task`)."""

    name: str
    instruction: str
    """`steps/<name>/instruction.md`."""
    time_budget_s: float
    """The step's agent budget: `[steps.agent].timeout_sec`, else the task's."""
    evaluator: EvaluatorSpec
    """The step's verifier: its tests/ over the task's, its timeout and env over the task's."""
    reference: dict | None
    """`steps/<name>/solution/solve.sh`, else the task's solution/solve.sh (Harbor's oracle)."""
    agent_user: str | None = None
    verifier_user: str | None = None
    min_reward: dict[str, float] | None = None
    """Reward key -> threshold: below any (or missing), the steps after it do not run."""


@dataclass(frozen=True)
class Task:
    task_id: str
    instruction: str
    workspace: WorkspaceSource
    setup: str | None
    """Shell command run in the fresh workspace before the harness starts (not part of the budget)."""
    evaluator: EvaluatorSpec
    time_budget_s: float
    """Wall-clock budget of the harness; past it the execution is timed out (workspace still scored)."""
    reference: dict | None = None
    """A reference solution: {"files": {path: text}} written into the workspace, {"command": sh}
    run in it, or {"solve_sh": path} (Harbor: run in the task's sandbox); `gyre-task check` scores
    it and the warm start trains on its files."""
    environment: TaskEnvironment | None = None
    """Harbor tasks: the container contract (workdir, /tests, /logs, limits); None: Gyre's own spec."""
    steps: tuple[TaskStep, ...] = ()
    """A Harbor multi-step task's steps, run one after another in one environment
    (gyre/harness/steps.py); empty: a task of one step (the fields above)."""
    step_reward: str = "mean"
    """How the steps' rewards make the execution's: one of STEP_REWARDS."""


def step_task(task: Task, index: int) -> Task:
    """The task as its step `index` runs: that step's instruction, budget, verifier, oracle and users,
    a task of one step."""
    step = task.steps[index]
    contract = task.environment
    users = {
        "agent_user": step.agent_user or contract.agent_user,
        "verifier_user": step.verifier_user or contract.verifier_user,
    }
    return replace(
        task,
        instruction=step.instruction,
        time_budget_s=step.time_budget_s,
        evaluator=step.evaluator,
        reference=step.reference,
        environment=replace(contract, **users),
        steps=(),
    )


def _where(obj: dict, where: str) -> str:
    tid = obj.get("task_id")
    return f"task {tid!r}" if isinstance(tid, str) and tid else where


def _text_map(value, where: str, name: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise TaskSpecError(where, name, "must be an object of relative path -> text")
    for k in value:
        if not k or k.startswith("/") or ".." in Path(k).parts:
            raise TaskSpecError(where, name, f"path {k!r} must be relative and stay inside the workspace")
    return dict(value)


def resolve_path(location: str, base: Path) -> Path:
    """`pkg:<p>` inside the gyre package, absolute as is, else relative to `base`."""
    if location.startswith("pkg:"):
        return Path(str(resources.files("gyre"))) / location[4:]
    p = Path(location)
    return p if p.is_absolute() else base / p


def _workspace(value, where: str, base: Path) -> WorkspaceSource:
    if not isinstance(value, dict) or len(value.keys() & set(WORKSPACE_KINDS)) != 1:
        raise TaskSpecError(where, "workspace", f"must be an object with exactly one of {', '.join(WORKSPACE_KINDS)}")
    kind = next(k for k in WORKSPACE_KINDS if k in value)
    if kind == "files":
        return WorkspaceSource("files", files=_text_map(value["files"], where, "workspace.files"))
    loc = value[kind]
    if not isinstance(loc, str) or not loc:
        raise TaskSpecError(where, f"workspace.{kind}", "must be a non-empty string")
    if kind == "git":
        commit = value.get("commit")
        if not isinstance(commit, str) or not commit:
            raise TaskSpecError(where, "workspace.commit", "a git workspace needs the commit to check out")
        is_remote = "://" in loc or loc.startswith("git@")
        path = loc if is_remote else str(resolve_path(loc, base))
        return WorkspaceSource("git", path, commit=commit)
    path = resolve_path(loc, base)
    if kind == "dir" and not path.is_dir():
        raise TaskSpecError(where, "workspace.dir", f"{path} is not a directory")
    if kind == "tar" and not path.is_file():
        raise TaskSpecError(where, "workspace.tar", f"{path} is not a file")
    return WorkspaceSource(kind, str(path))


def _evaluator(value, where: str) -> EvaluatorSpec:
    if not isinstance(value, dict):
        raise TaskSpecError(where, "evaluator", "must be an object with a `kind`")
    kind = value.get("kind")
    if kind not in EVALUATOR_KINDS:
        raise TaskSpecError(where, "evaluator.kind", f"{kind!r} is not one of {', '.join(EVALUATOR_KINDS)}")
    timeout_s = value.get("timeout_s", 60.0)
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
        raise TaskSpecError(where, "evaluator.timeout_s", f"must be a positive number of seconds, got {timeout_s!r}")
    if kind == "files":
        files = _text_map(value.get("files"), where, "evaluator.files")
        if not files:
            raise TaskSpecError(where, "evaluator.files", "needs at least one expected file")
        return EvaluatorSpec("files", files=files, timeout_s=float(timeout_s))
    command = value.get("command")
    if not isinstance(command, str) or not command.strip():
        raise TaskSpecError(where, "evaluator.command", f"a {kind} evaluator needs a shell command")
    return EvaluatorSpec(kind, command=command, timeout_s=float(timeout_s))


def _reference(value, where: str) -> dict | None:
    if value is None:
        return None
    if isinstance(value, dict) and set(value) == {"files"}:
        return {"files": _text_map(value["files"], where, "reference.files")}
    if isinstance(value, dict) and set(value) == {"command"} and isinstance(value["command"], str):
        return dict(value)
    raise TaskSpecError(where, "reference", 'must be null, {"files": {...}} or {"command": "..."}')


def parse_task(obj, where: str, base: Path) -> Task:
    """A validated Task from one spec object (`where` names it in errors until its id is known).

    Raises:
        TaskSpecError: naming the task and the field.
    """
    if not isinstance(obj, dict):
        raise TaskSpecError(where, "(spec)", "must be a JSON object")
    where = _where(obj, where)
    known = {"task_id", "instruction", "workspace", "setup", "evaluator", "time_budget_s", "reference"}
    if unknown := sorted(set(obj) - known):
        raise TaskSpecError(where, unknown[0], f"unknown field; valid: {', '.join(sorted(known))}")
    tid = obj.get("task_id")
    if not isinstance(tid, str) or not tid or not all(c.isalnum() or c in "-_." for c in tid):
        raise TaskSpecError(where, "task_id", f"must be a non-empty string of letters, digits, - _ . (got {tid!r})")
    instruction = obj.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise TaskSpecError(where, "instruction", "must be a non-empty string")
    setup = obj.get("setup")
    if setup is not None and not isinstance(setup, str):
        raise TaskSpecError(where, "setup", "must be a shell command string or null")
    budget = obj.get("time_budget_s")
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or budget <= 0:
        raise TaskSpecError(where, "time_budget_s", f"must be a positive number of seconds, got {budget!r}")
    return Task(
        task_id=tid,
        instruction=instruction,
        workspace=_workspace(obj.get("workspace"), where, base),
        setup=setup,
        evaluator=_evaluator(obj.get("evaluator"), where),
        time_budget_s=float(budget),
        reference=_reference(obj.get("reference"), where),
    )


def read_specs(path: Path) -> list[tuple[object, str]]:
    if path.is_dir():
        out = []
        for f in sorted(path.glob("*.json")):
            try:
                out.append((jsonio.loads(f.read_text()), f.name))
            except jsonio.DecodeError as e:
                raise TaskSpecError(f.name, "(spec)", f"not valid JSON ({e})") from None
        return out
    out = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                out.append((jsonio.loads(line), f"{path.name} line {n}"))
            except jsonio.DecodeError as e:
                raise TaskSpecError(f"{path.name} line {n}", "(spec)", f"not valid JSON ({e})") from None
    return out
