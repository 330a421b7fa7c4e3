"""The coordinator's own settings: batch shape, admission, micro-batching, checkpoints, local cells."""

from dataclasses import dataclass

from gyre.errors import require

RUN_MODES = ("train", "replay", "rollout")
"""train: roll out and train (the product); replay: train from a records directory and its ledger,
no rollouts; rollout: roll out and evaluate, never train (weights stay at version 0)."""


@dataclass(kw_only=True)
class CoordinatorConfig:
    group_size: int = 8
    """G: executions of one task per group (GRPO normalises rewards within a group); >= 2. A group
    whose executions all score alike teaches nothing (excluded as `uniform_group`): with 8 that is
    about half as frequent as with 4 on the toy once its policy succeeds most of the time."""
    groups_per_step: int = 2
    """Groups that make one RL step's batch."""
    sessions_per_cell: int = 32
    """Executions one rollout cell serves at once; more wait in the queue (the waterlevel counts both)."""
    max_micro_batch_tokens: int = 8192
    """Tokens packed into one micro-batch (a longer path is an error naming this key)."""
    tick_s: float = 0.2
    """Seconds between two turns of the coordinator's loop."""
    checkpoint_every_steps: int = 1
    """Checkpoint the core after every this many optimizer steps (and at the end)."""
    cpus_per_cell: float = 0.5
    """Local cells: CPU quota of each cell's processes (cgroup), like a fixed number of GPUs."""
    cell_start_timeout_s: float = 300.0
    """How long the cell leaders may take to build their trainer and engine."""
    decode_window_s: float = 10.0
    """Trailing window, seconds, over which the proxy's per-engine counters give the decode speed,
    demand and capacity the policy sees (gyre.scheduler.decode)."""
    train_tok_s: float = 2000.0
    """Training throughput of one cell, tokens/s, the policy assumes until the first step measures it."""
    init_weights: str | None = None
    """Engine-format model directory the core starts from; None: the seeded init (tasks may warm-start)."""

    def __post_init__(self):
        require(self.group_size >= 2, "group_size", f"GRPO needs >= 2 executions per group, got {self.group_size}")
        require(self.groups_per_step >= 1, "groups_per_step", f"must be >= 1, got {self.groups_per_step}")
        require(self.sessions_per_cell >= 1, "sessions_per_cell", f"must be >= 1, got {self.sessions_per_cell}")
        require(
            self.max_micro_batch_tokens >= 16,
            "max_micro_batch_tokens",
            f"must be >= 16, got {self.max_micro_batch_tokens}",
        )
        require(self.tick_s > 0, "tick_s", f"must be > 0 s, got {self.tick_s}")
        require(
            self.checkpoint_every_steps >= 1,
            "checkpoint_every_steps",
            f"must be >= 1, got {self.checkpoint_every_steps}",
        )
        require(self.cpus_per_cell > 0, "cpus_per_cell", f"must be > 0, got {self.cpus_per_cell}")
        require(self.decode_window_s > 0, "decode_window_s", f"must be > 0 s, got {self.decode_window_s}")
        require(self.train_tok_s > 0, "train_tok_s", f"must be > 0, got {self.train_tok_s}")
        require(
            self.cell_start_timeout_s > 0, "cell_start_timeout_s", f"must be > 0 s, got {self.cell_start_timeout_s}"
        )
