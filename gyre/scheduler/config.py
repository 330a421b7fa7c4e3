"""Configuration of the cell scheduler: the mode, the staleness bound, and role-switch costs."""

from dataclasses import dataclass

from gyre.errors import require

MODES = ("elastic", "async", "colocate")
"""elastic: satellites switch roles by waterlevel; async: fixed rollout and train pools;
colocate: all cells roll out a batch, then all train."""


@dataclass(kw_only=True)
class SchedulerConfig:
    """One policy, three modes, same budget and staleness bound."""

    mode: str = "elastic"
    """One of MODES."""
    staleness: int = 1
    """An execution started under weight version v may be trained at step <= v + staleness."""
    rollout_to_train_s: float = 8.52
    """Expected cost of a rollout->train switch, seconds (the seed's measured average)."""
    train_to_rollout_s: float = 3.46
    """Expected cost of a train->rollout switch, seconds (the seed's measured average)."""

    def __post_init__(self):
        require(self.mode in MODES, "mode", f"must be one of {', '.join(MODES)}; got {self.mode!r}")
        require(self.staleness >= 0, "staleness", f"must be >= 0, got {self.staleness}")
        require(self.rollout_to_train_s >= 0, "rollout_to_train_s", f"must be >= 0 s, got {self.rollout_to_train_s}")
        require(self.train_to_rollout_s >= 0, "train_to_rollout_s", f"must be >= 0 s, got {self.train_to_rollout_s}")
