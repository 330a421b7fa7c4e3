"""Task sets: the tasks a run draws from, in Gyre's own specs (gyre/tasks/spec.py) or Harbor task
folders (gyre/tasks/harbor.py), and the seeded order a run draws them in."""

import hashlib
import random
from pathlib import Path
from typing import Protocol

from gyre.tasks.config import TasksConfig
from gyre.tasks.harbor import is_harbor_set, load_harbor_tasks
from gyre.tasks.spec import Task, TaskSpecError, parse_task, read_specs, resolve_path

TOY_TASKSET = "pkg:tasks/toy/tasks.jsonl"


class TaskSource(Protocol):
    """The tasks a run draws from, as the coordinator asks for them (TaskSet reads Gyre's specs; another
    task format implements these two methods and hands its object to `gyre.coordinator.loop.run`)."""

    def get(self, task_id: str) -> Task:
        """The task `task_id` (a resumed or replayed run finds its groups' tasks again).

        Raises:
            TaskSpecError: no such task.
        """

    def pick(self, seed: int, cursor: int) -> Task:
        """The task of the `cursor`-th group drawn: deterministic in (seed, cursor), so a resume continues the order."""


class TaskSet(TaskSource):
    """An ordered, validated list of tasks and a deterministic draw order over them."""

    def __init__(self, tasks: list[Task], name: str = ""):
        if not tasks:
            raise TaskSpecError(name or "task set", "(tasks)", "no tasks")
        ids = [t.task_id for t in tasks]
        if dup := sorted({i for i in ids if ids.count(i) > 1}):
            raise TaskSpecError(f"task {dup[0]!r}", "task_id", "used by more than one task")
        self.tasks, self.name = list(tasks), name
        self._by_id = {t.task_id: t for t in tasks}

    @classmethod
    def load(cls, path: str | Path, options: TasksConfig | None = None) -> "TaskSet":
        """Read and validate a directory of `*.json` specs, a JSONL file (`pkg:` paths allowed) or
        a folder of Harbor task folders (read with `options`' max_agent_timeout_s and clip_reward).

        Raises:
            TaskSpecError: a missing set, bad JSON or TOML, or a bad field (naming task and field).
        """
        p = resolve_path(str(path), Path.cwd())
        if not p.exists():
            raise TaskSpecError(
                str(path), "(path)", "no such task set (a directory of *.json, a .jsonl file or Harbor task folders)"
            )
        if is_harbor_set(p):
            opts = options or TasksConfig()
            return cls(load_harbor_tasks(p, opts.max_agent_timeout_s, opts.clip_reward), name=str(path))
        base = p if p.is_dir() else p.parent
        return cls([parse_task(obj, where, base) for obj, where in read_specs(p)], name=str(path))

    def __len__(self) -> int:
        return len(self.tasks)

    def get(self, task_id: str) -> Task:
        if task_id not in self._by_id:
            raise TaskSpecError(f"task {task_id!r}", "task_id", f"not in {self.name}; valid: {', '.join(self._by_id)}")
        return self._by_id[task_id]

    def pick(self, seed: int, cursor: int) -> Task:
        """The cursor-th task of the seeded order: each epoch (len(tasks) draws) is a fresh
        permutation, so every task comes once per epoch and a resumed run continues the cursor."""
        if cursor < 0:
            raise ValueError(f"cursor must be >= 0, got {cursor}")
        epoch, i = divmod(cursor, len(self.tasks))
        digest = hashlib.sha256(f"{seed}:{epoch}".encode()).digest()
        order = list(range(len(self.tasks)))
        random.Random(int.from_bytes(digest[:8], "little")).shuffle(order)
        return self.tasks[order[i]]


def toy_taskset() -> TaskSet:
    """The embedded default task set (shipped inside the package)."""
    return TaskSet.load(TOY_TASKSET)
