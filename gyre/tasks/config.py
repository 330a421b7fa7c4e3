"""Tasks config (Hydra group `tasks`): which task set executions draw from, and the warm start."""

from dataclasses import dataclass

from gyre.errors import require


@dataclass(kw_only=True)
class TasksConfig:
    """The task set and the optional warm start of the policy (see gyre/tasks/warmstart.py).

    The toy profile's tool-duration distribution belongs to the toy agent: `harness.toy.tool_*`.
    """

    taskset: str | None = None
    """A directory of *.json specs or a JSONL file; None: the embedded toy set."""
    seed: int = 0
    """Seed of the draw order (`TaskSet.pick(seed, cursor)`); a resumed run keeps it and its cursor."""
    warm_start: bool = True
    """Start RL from the supervised warm start on the set's reference transcripts (cached)."""
    warm_start_dir: str = "~/.cache/gyre/warmstart"
    """Cache of warm-started model directories (one per content hash)."""
    warm_start_steps: int = 60
    warm_start_lr: float = 3e-3

    def __post_init__(self):
        require(self.taskset is None or bool(self.taskset.strip()), "taskset", "must be a path or null (the toy set)")
        require(self.warm_start_steps >= 1, "warm_start_steps", "must be >= 1")
        require(self.warm_start_lr > 0, "warm_start_lr", "must be > 0")
