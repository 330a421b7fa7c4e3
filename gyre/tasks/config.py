"""Which task set a run draws from, and whether the initial policy is warm-started on it."""

from dataclasses import dataclass

from gyre.errors import require


@dataclass(kw_only=True)
class TasksConfig:
    path: str | None = None
    """Task set: a directory or JSONL file of task specs (gyre.tasks.spec); None: the embedded toy set."""
    warm_start: bool = True
    """Without coordinator.init_weights: start RL from a policy trained on the task set's reference
    solutions (gyre.tasks.warmstart), so rewards vary from the first step; False: the seeded init."""
    warm_start_dir: str = "outputs/warmstart"
    """Cache of warm-started models (relative to the launch directory), reused when the inputs match."""

    def __post_init__(self):
        require(bool(self.warm_start_dir), "warm_start_dir", "must name a directory")
