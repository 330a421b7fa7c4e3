"""Configuration of the trajectory processor: path cap, loss averaging, reward and advantage rules."""

from dataclasses import dataclass

from gyre.errors import require

AVERAGING_MODES = ("path", "execution", "token")
"""path: an execution's loss is the mean over its selected paths of each path's summed token loss
(branching adds no weight; no length bias); execution: each execution's targets share a total
weight of 1 (equal weight per execution, but a short execution's tokens weigh more: length-biased);
token: every target weighs 1 (an execution that branches weighs more; ablation)."""


@dataclass(kw_only=True)
class TrajectoryConfig:
    """How an execution's call tree becomes weighted training targets."""

    max_paths: int = 5
    """K: at most this many paths per execution, in priority main > main summary > sub-agent >
    sub-agent summary (the seed's cap of five matched uncapped scores with 25% less compute)."""
    averaging: str = "path"
    """One of AVERAGING_MODES. The trainer divides the step's summed weighted loss by the step's
    summed loss_weights, so `path` gives a mean over paths (each path's tokens summed), `execution` a
    mean over executions, `token` a mean over targets."""
    allow_missing_calls: bool = False
    """False: an execution whose record sequence numbers have gaps is excluded (`missing_call`).
    True: it is kept; the lost calls' outputs are then context, never targets."""
    normalize_std: bool = True
    """GRPO: divide group-centred rewards by the group's standard deviation (False: Dr. GRPO)."""
    std_eps: float = 1e-6
    """Added to the group standard deviation before dividing."""
    min_group_size: int = 2
    """Groups with fewer valid executions after exclusions are excluded (`group_too_small`)."""
    drop_uniform_groups: bool = True
    """Exclude groups whose valid rewards are all equal (`uniform_group`): zero advantage, no signal."""

    def __post_init__(self):
        require(self.max_paths >= 1, "max_paths", f"must be >= 1, got {self.max_paths}")
        require(
            self.averaging in AVERAGING_MODES,
            "averaging",
            f"must be one of {', '.join(AVERAGING_MODES)}; got {self.averaging!r}",
        )
        require(self.std_eps > 0, "std_eps", f"must be > 0, got {self.std_eps}")
        require(self.min_group_size >= 1, "min_group_size", f"must be >= 1, got {self.min_group_size}")
