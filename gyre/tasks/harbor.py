"""Harbor task folders as Gyre tasks (pure but for reading the folders).

A Harbor task (Terminal-Bench 2.0, Harbor's benchmark adapters, Repo2RLEnv) is a folder:

    task.toml        [agent].timeout_sec / user / network_mode, [verifier].timeout_sec / env / user /
                     network_mode / environment_mode, [solution].env, [environment] docker_image,
                     workdir (default: the image's WORKDIR, else /app), cpus, memory_mb (or memory =
                     "4G"), storage_mb, gpus, build_timeout_sec, env, network_mode / allow_internet
                     (gyre/tasks/harbor_fields.py reads the phase fields)
    instruction.md   the instruction
    environment/     a Dockerfile, or the files the workspace starts from
    tests/test.sh    run as `bash /tests/test.sh` after the agent; writes /logs/verifier/reward.txt|json
    solution/solve.sh  the oracle (optional)
    steps/<name>/    a multi-step task's steps (`[[steps]]`: gyre/tasks/harbor_steps.py), run one after
                     another in one environment, each verified after its agent (gyre/harness/steps.py)

A folder with `task.toml` is a task (its name is the task id); any other folder is searched for
tasks up to MAX_DEPTH levels down. Every error names the folder and the field. Without
`[agent].timeout_sec` Harbor sets no limit; Gyre bounds it by `max_agent_timeout_s`
(`tasks.max_agent_timeout_s`).
"""

import re
import tomllib
from dataclasses import replace
from pathlib import Path, PurePosixPath

from gyre.tasks.harbor_fields import (
    check_unsupported,
    parse_gpus,
    parse_networks,
    parse_user,
    parse_verification,
    resolve_env,
)
from gyre.tasks.harbor_steps import parse_step_reward, parse_steps
from gyre.tasks.spec import EvaluatorSpec, Task, TaskEnvironment, TaskSpecError, WorkspaceSource

MAX_DEPTH = 3
"""How many folder levels below a task set are searched for task folders."""
DEFAULT_TIMEOUT_S = 600.0
"""Harbor's default for `[verifier].timeout_sec` (and `build_timeout_sec`)."""
MAX_AGENT_TIMEOUT_S = 4 * 3600.0
"""The agent's budget where the task sets none (Harbor: no limit); `tasks.max_agent_timeout_s`."""
CONTRACT_PATHS = ("/tests", "/logs", "/solution")
"""Where the verifier contract puts its own files; a workdir cannot be (or be under) one of them."""
SYSTEM_DIRS = ("bin", "dev", "etc", "lib", "lib64", "proc", "sbin", "sys", "usr")
"""Host folders a workdir's top-level folder cannot be: the sandbox replaces that folder (contract.py)."""
VERIFIER_COMMAND = "bash /tests/test.sh"
_UNITS_MB = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024**2}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGTkmgt])i?[Bb]?")


def find_task_dirs(root: Path, depth: int = MAX_DEPTH) -> list[Path]:
    """The Harbor task folders at or below `root` (sorted; a task folder is not searched further)."""
    if (root / "task.toml").is_file():
        return [root]
    if depth <= 0:
        return []
    children = sorted(c for c in root.iterdir() if c.is_dir() and not c.name.startswith("."))
    return [t for c in children for t in find_task_dirs(c, depth - 1)]


def is_harbor_set(path: Path) -> bool:
    """A Harbor task folder, or a folder of them rather than of Gyre `*.json` specs."""
    if not path.is_dir():
        return False
    return (path / "task.toml").is_file() or (not any(path.glob("*.json")) and bool(find_task_dirs(path)))


def load_harbor_tasks(
    root: Path, max_agent_timeout_s: float = MAX_AGENT_TIMEOUT_S, clip_reward: bool = False
) -> list[Task]:
    """Every Harbor task folder under `root`, loaded.

    Raises:
        TaskSpecError: naming the folder and the field.
    """
    return [load_harbor_task(d, max_agent_timeout_s, clip_reward) for d in find_task_dirs(root)]


def _number(table: dict, key: str, where: str, name: str, default=None):
    value = table.get(key, default)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise TaskSpecError(where, name, f"must be a positive number, got {value!r}")
    return value


def parse_memory_mb(env: dict, where: str) -> int | None:
    """`memory_mb` (an integer of MB) or the older `memory` (a size with its unit: "4G", "512M")."""
    if "memory_mb" in env:
        return int(_number(env, "memory_mb", where, "environment.memory_mb"))
    text = env.get("memory")
    if text is None:
        return None
    m = _SIZE.fullmatch(text.strip()) if isinstance(text, str) else None
    mb = float(m[1]) * _UNITS_MB[m[2].upper()] if m else 0
    if mb < 1:
        raise TaskSpecError(where, "environment.memory", f'must be a size such as "4G" or "512M", got {text!r}')
    return int(mb)


def _workdir(env: dict, where: str, has_image: bool) -> str:
    """`[environment].workdir`; unset: "" (the image's WORKDIR) for a task with an image, else /app."""
    if "workdir" not in env:
        return "" if has_image else "/app"
    return check_workdir(env["workdir"], where)


def check_workdir(workdir, where: str) -> str:
    """A workdir the sandboxes can mount the workspace at (from the toml or the image).

    Raises:
        TaskSpecError: naming environment.workdir.
    """
    p = PurePosixPath(workdir) if isinstance(workdir, str) else None
    if p is None or not p.is_absolute() or ".." in p.parts or len(p.parts) < 2:
        raise TaskSpecError(where, "environment.workdir", f"must be an absolute path below /, got {workdir!r}")
    if any(str(p) == c or str(p).startswith(c + "/") for c in CONTRACT_PATHS):
        raise TaskSpecError(where, "environment.workdir", f"{workdir} is where the verifier contract puts its files")
    if p.parts[1] in SYSTEM_DIRS:
        raise TaskSpecError(where, "environment.workdir", f"{workdir} would hide the host's /{p.parts[1]}")
    return str(p)


def _table(cfg: dict, name: str, where: str) -> dict:
    value = cfg.get(name, {})
    if not isinstance(value, dict):
        raise TaskSpecError(where, name, "must be a table ([" + name + "])")
    return value


def _read(folder: Path, where: str) -> tuple[dict, str]:
    """(task.toml, instruction.md); a multi-step task has no instruction of its own (its steps' instead)."""
    try:
        cfg = tomllib.loads((folder / "task.toml").read_text())
    except (tomllib.TOMLDecodeError, UnicodeError) as e:
        raise TaskSpecError(where, "task.toml", f"not valid TOML ({e})") from None
    if cfg.get("steps"):
        return cfg, ""
    md = folder / "instruction.md"
    instruction = md.read_text(errors="replace") if md.is_file() else ""
    if not instruction.strip():
        raise TaskSpecError(where, "instruction.md", "missing or empty")
    if not (folder / "tests" / "test.sh").is_file():
        raise TaskSpecError(where, "tests/test.sh", "missing: the verifier runs `bash /tests/test.sh`")
    return cfg, instruction


def _contract(folder: Path, cfg: dict, image: str, where: str) -> TaskEnvironment:
    """The task's environment contract from its [environment], [agent], [verifier] and [solution] tables."""
    agent, verifier, env = (_table(cfg, n, where) for n in ("agent", "verifier", "environment"))
    dockerfile = folder / "environment" / "Dockerfile"
    cpus = _number(env, "cpus", where, "environment.cpus")
    storage = _number(env, "storage_mb", where, "environment.storage_mb")
    agent_net, asked, verifier_net, verifier_asked = parse_networks(agent, verifier, env, where)
    return TaskEnvironment(
        task_dir=str(folder),
        workdir=_workdir(env, where, bool(image) or dockerfile.is_file()),
        docker_image=image,
        dockerfile=str(dockerfile) if dockerfile.is_file() else "",
        cpus=None if cpus is None else float(cpus),
        memory_mb=parse_memory_mb(env, where),
        storage_mb=None if storage is None else int(storage),
        build_timeout_s=float(
            _number(env, "build_timeout_sec", where, "environment.build_timeout_sec", DEFAULT_TIMEOUT_S)
        ),
        gpus=parse_gpus(env, where),
        env=resolve_env(env, "environment", where),
        solution_env=resolve_env(_table(cfg, "solution", where), "solution", where),
        agent_user=parse_user(agent, "agent", where),
        verifier_user=parse_user(verifier, "verifier", where),
        agent_network=agent_net,
        agent_network_asked=asked,
        verifier_network=verifier_net,
        verifier_network_asked=verifier_asked,
        verification=parse_verification(verifier, where),
    )


def load_harbor_task(folder: Path, max_agent_timeout_s: float = MAX_AGENT_TIMEOUT_S, clip_reward: bool = False) -> Task:
    """One Harbor task folder as a Task (its id is the folder name).

    Raises:
        TaskSpecError: naming the folder and the field.
    """
    folder = Path(folder).resolve()
    where = f"harbor task {folder}"
    if not all(c.isalnum() or c in "-_." for c in folder.name):
        raise TaskSpecError(where, "task_id", "the folder name must be letters, digits, - _ .")
    cfg, instruction = _read(folder, where)
    check_unsupported(folder, where)
    agent, verifier, env = (_table(cfg, n, where) for n in ("agent", "verifier", "environment"))
    image = env.get("docker_image", "")
    if not isinstance(image, str):
        raise TaskSpecError(where, "environment.docker_image", f"must be an image name, got {image!r}")
    env_dir = folder / "environment"
    contract = _contract(folder, cfg, image, where)
    tests = folder / "tests"
    evaluator = EvaluatorSpec(
        "harbor",
        command=VERIFIER_COMMAND,
        timeout_s=float(_number(verifier, "timeout_sec", where, "verifier.timeout_sec", DEFAULT_TIMEOUT_S)),
        env=resolve_env(verifier, "verifier", where),
        clip_reward=clip_reward,
        tests=(str(tests),) if tests.is_dir() else (),
    )
    budget = float(_number(agent, "timeout_sec", where, "agent.timeout_sec", max_agent_timeout_s))
    solve = folder / "solution" / "solve.sh"
    task = Task(
        task_id=folder.name,
        instruction=instruction,
        workspace=WorkspaceSource("dir", str(env_dir)) if env_dir.is_dir() else WorkspaceSource("files"),
        setup=None,
        evaluator=evaluator,
        time_budget_s=budget,
        reference={"solve_sh": str(solve)} if solve.is_file() else None,
        environment=contract,
    )
    steps = parse_steps(cfg, folder, evaluator, budget, where)
    if not steps:
        return task
    # The whole task, as listed: its first step's instruction, all its steps' budgets.
    total_s = sum(s.time_budget_s for s in steps)
    return replace(
        task,
        instruction=steps[0].instruction,
        time_budget_s=total_s,
        steps=steps,
        step_reward=parse_step_reward(cfg, where),
    )
