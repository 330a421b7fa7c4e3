"""Configuration of a run's observability: TensorBoard, W&B, progress, figures (the events file is
always `run_dir/events.jsonl`, gyre.common.run_paths.RunPaths.events: every process and reader finds it there)."""

from dataclasses import dataclass
from importlib.util import find_spec

from gyre.errors import require

PROGRESS_MODES = ("auto", "live", "plain", "off")
"""auto: a live rich display on a terminal, plain lines otherwise (Slurm logs); live / plain force one."""
WANDB_MODES = ("online", "offline")


@dataclass(kw_only=True)
class MetricsConfig:
    """Where events go and how often the views built from them refresh."""

    tensorboard: bool = True
    """Write TensorBoard event files (coordinator only)."""
    tensorboard_dir: str = "tensorboard"
    """Relative to the run directory."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the `wandb` package; off by default)."""
    wandb_project: str = "gyre"
    wandb_entity: str = ""
    """Empty: the W&B default entity."""
    wandb_mode: str = "online"
    """One of WANDB_MODES; offline writes under the run directory and syncs later (`wandb sync`)."""
    progress: str = "auto"
    """One of PROGRESS_MODES."""
    progress_interval_s: float = 30.0
    """Plain progress lines at most this often (and at every optimizer step)."""
    figures: bool = True
    """Draw timeline.png, reward.png, tokens.png and utilisation.png into the run directory (coordinator only)."""
    plots_interval_s: float = 300.0
    """Redraw timeline.png, reward.png and utilisation.png during the run at most this often (0: only at the end)."""
    rate_window_s: float = 60.0
    """Calls/s and tokens/s are averaged over this trailing window."""
    sample_interval_s: float = 10.0
    """Cluster samples (waterlevel, cells per role, rates, outcomes) go to TensorBoard / W&B at most
    this often: the coordinator observes every second, which over days would swamp both."""

    def __post_init__(self):
        require(bool(self.tensorboard_dir), "tensorboard_dir", "must name a directory")
        require(
            not self.wandb or find_spec("wandb") is not None,
            "wandb",
            "needs the wandb package (pip install wandb), or set metrics.wandb=false",
        )
        require(
            self.wandb_mode in WANDB_MODES,
            "wandb_mode",
            f"must be one of {', '.join(WANDB_MODES)}; got {self.wandb_mode!r}",
        )
        require(
            self.progress in PROGRESS_MODES,
            "progress",
            f"must be one of {', '.join(PROGRESS_MODES)}; got {self.progress!r}",
        )
        require(self.progress_interval_s > 0, "progress_interval_s", f"must be > 0, got {self.progress_interval_s}")
        require(
            self.plots_interval_s >= 0,
            "plots_interval_s",
            f"must be >= 0 (0: only at the end), got {self.plots_interval_s}",
        )
        require(self.rate_window_s > 0, "rate_window_s", f"must be > 0, got {self.rate_window_s}")
        require(self.sample_interval_s >= 0, "sample_interval_s", f"must be >= 0, got {self.sample_interval_s}")
