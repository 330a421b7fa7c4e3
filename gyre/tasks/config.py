"""Which task set a run draws from, its held-out set, and whether the initial policy is warm-started on it."""

from dataclasses import dataclass

from gyre.errors import require

TOY_HELD_OUT = "pkg:tasks/toy/eval.jsonl"
"""The embedded toy set's held-out tasks: (word, file) pairs never in its training set."""


@dataclass(kw_only=True)
class TasksConfig:
    path: str | None = None
    """Task set: a directory or JSONL file of task specs (gyre.tasks.spec); None: the embedded toy set."""
    eval_path: str | None = None
    """Held-out task set (never trained on), rolled out under the first and the last weights of a
    run and every `eval_every` steps between (summary: eval_reward_first, eval_reward_last, each with
    its standard error); None: the toy's held-out set when `path` is None, else no held-out rollouts."""
    eval_samples: int = 12
    """Executions per held-out task at each evaluated version; 0: no held-out rollouts."""
    eval_every: int = 10
    """Also roll the held-out set out under every this many steps' weights (0: only the first and the last)."""
    warm_start: bool = True
    """Without coordinator.init_weights: start RL from a policy trained on the task set's reference
    solutions (gyre.launch.warmstart), so rewards vary from the first step; False: the seeded init."""
    max_agent_timeout_s: float = 4 * 3600.0
    """A Harbor task's agent budget where its task.toml sets no `[agent].timeout_sec` (Harbor: no limit)."""
    clip_reward: bool = False
    """Clip a Harbor verifier's reward to [0, 1]; False: keep it as written, as Harbor does (advantages
    are normalised per group, so any finite reward trains)."""
    warm_start_dir: str = "outputs/warmstart"
    """Cache of warm-started models (relative to the launch directory), reused when the inputs match."""

    def __post_init__(self):
        require(bool(self.warm_start_dir), "warm_start_dir", "must name a directory")
        require(self.max_agent_timeout_s > 0, "max_agent_timeout_s", f"must be > 0 s, got {self.max_agent_timeout_s}")
        require(self.eval_samples >= 0, "eval_samples", f"must be >= 0, got {self.eval_samples}")
        require(self.eval_every >= 0, "eval_every", f"must be >= 0 steps, got {self.eval_every}")

    @property
    def held_out_path(self) -> str | None:
        """The held-out set the run rolls out, if any (see eval_path)."""
        if self.eval_samples == 0:
            return None
        return self.eval_path or (TOY_HELD_OUT if self.path is None else None)

    def eval_versions(self, num_steps: int) -> set[int]:
        """The weight versions a run of `num_steps` steps evaluates its held-out set under."""
        every = range(self.eval_every, num_steps, self.eval_every) if self.eval_every else ()
        return {0, num_steps, *every}
