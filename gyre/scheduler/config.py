"""Configuration of the cell scheduler: the mode, the staleness bound, switch costs and the hysteresis.

Every mode reads the same staleness bound and switch costs, so a comparison between modes changes
one key (`mode`) and nothing else.
"""

from dataclasses import dataclass

from gyre.errors import require

MODES = ("elastic", "async", "colocate")
ASYNC_SPLITS = ("even", "work_share")
BATCHING = ("fixed", "first_ready")
"""Which step trains a ready group (see gyre.scheduler.streaming); the same in every mode."""
LEAVE_RULES = ("waterlevel", "value")
ADMISSION = ("step", "staleness")
"""elastic: satellites switch roles by waterlevel; async: fixed rollout and train pools;
colocate: all cells roll out a batch, then all train."""


@dataclass(kw_only=True)
class SchedulerConfig:
    """One policy, three modes, same budget and staleness bound."""

    mode: str = "elastic"
    """One of MODES."""
    staleness: int = 1
    """An execution started under weight version v may be trained at step <= v + staleness."""
    batching: str = "fixed"
    """One of BATCHING. fixed: a step waits for its own groups (no span masked, none dropped);
    first_ready: a step trains the first groups that become ready, spans older than the bound are
    masked out of the loss and executions with none left are dropped (faster on long tails, at a
    cost in training data the simulator reports as masked_fraction and stale_dropped)."""
    rollout_to_train_s: float = 8.52
    """Expected cost of a rollout->train switch, seconds (the seed's measured average)."""
    train_to_rollout_s: float = 3.46
    """Expected cost of a train->rollout switch, seconds (the seed's measured average)."""
    gain_factor: float = 2.0
    """elastic: a satellite leaves rollout only if the training work it would take is at least
    this many times the round-trip switch cost (rollout->train + train->rollout)."""
    leave_headroom: float = 0.1
    """elastic: after a satellite leaves, the remaining rollout cells must serve the live work
    (sessions and tokens/s) with this fraction to spare."""
    return_queue_fraction: float = 0.25
    """elastic: satellites return to rollout once queued executions reach this fraction of one
    cell's session capacity (and the serving cells cannot absorb them)."""
    critical_path: bool = False
    """elastic: True = executions queued for later steps (admitted early within the staleness
    bound) do not keep satellites from ready training work of the current step. False (default)
    = the plain waterlevel rule, where every queued execution counts; in the simulator it wins
    wherever step time is set by the slowest executions, which must start early."""
    leave_window_s: float = 300.0
    """elastic: the leave rule uses the peak waterlevel of this trailing window, so a waterlevel
    that only dips briefly never sends a cell away (seconds on the caller's clock)."""
    min_dwell_s: float = 60.0
    """elastic: a satellite keeps a role at least this long before switching again (no thrashing)."""
    finish_microstep_max_s: float = 30.0
    """A cell leaving training finishes its current micro-step if at most this much of it remains,
    seconds; otherwise it hands the micro-step back to the queue."""
    async_split: str = "even"
    """async: how the fixed pools are sized when `async_train_cells` is 0. even: half the cells
    train (rounded down, the core included), what a user picks before knowing the workload;
    work_share: in proportion to the workload's expected training/rollout work (an oracle a real
    run only has after measuring some steps)."""
    async_train_cells: int = 0
    """async: cells in the fixed training pool, the core included (0 = sized by `async_split`;
    the rest roll out)."""

    leave_rule: str = "value"
    """elastic, one of LEAVE_RULES. waterlevel: a satellite leaves only if the remaining cells
    serve the whole waterlevel with headroom. value: executions of later steps (queued or running,
    admitted early as the staleness bound allows) are deferrable: the remaining cells must keep
    every live session (GPU or offload tier) but serve with headroom only the current step's, and
    the ready training work on the critical path must pay for the round trip. The default: in the
    simulator (`compare=true`) never slower than waterlevel on a profile and preset, and 5-14 %
    faster on NL2Repo, where waterlevel loses to colocate at 192 nodes."""
    rebalance_on_return: bool = True
    """A cell that returns to rollout takes live sessions (between model calls) from the most
    loaded serving cells until loads are even (proxy reroute + KV migration through the offload
    tier), instead of waiting for new sessions to fill it. The default: it runs live (the proxy's
    pool moves the sessions with their KV), and in the simulator it brings elastic closer to its own
    bound (NL2Repo, 48 steps, 24 / 32 / 192 nodes: 1.089 / 1.060 / 1.094x against 1.116 / 1.084 /
    1.114x without it; tools/bench/sim_defaults.py [scheduler.rebalance_on_return=false]): a cell
    that returns to relieve decode serves at once."""
    microstep_tokens: int = 0
    """Token bound of one micro-step (0 = one group per micro-step): a group's training splits
    into micro-steps of at most this many tokens, so every training cell shares the burst of
    training after the batch is ready. Gradients accumulate the same either way."""
    admission: str = "step"
    """One of ADMISSION. step: a batch of step k starts once optimizer step k - s - 1 is applied.
    staleness: it starts once step k - s - 1's batch is ready (no more rollout for it); spans
    generated before version k - s is published fall outside the bound and are masked out of the
    loss (trained_spans), so no trained token is older than the bound, at a cost in training data
    the simulator reports as masked_fraction and stale_dropped."""

    def __post_init__(self):
        require(self.mode in MODES, "mode", f"must be one of {', '.join(MODES)}; got {self.mode!r}")
        require(self.batching in BATCHING, "batching", f"must be one of {', '.join(BATCHING)}; got {self.batching!r}")
        require(self.staleness >= 0, "staleness", f"must be >= 0, got {self.staleness}")
        require(self.rollout_to_train_s >= 0, "rollout_to_train_s", f"must be >= 0 s, got {self.rollout_to_train_s}")
        require(self.train_to_rollout_s >= 0, "train_to_rollout_s", f"must be >= 0 s, got {self.train_to_rollout_s}")
        require(self.gain_factor >= 1, "gain_factor", f"must be >= 1 (gain at least the cost), got {self.gain_factor}")
        require(self.leave_headroom >= 0, "leave_headroom", f"must be >= 0, got {self.leave_headroom}")
        require(
            self.return_queue_fraction > 0, "return_queue_fraction", f"must be > 0, got {self.return_queue_fraction}"
        )
        require(self.leave_window_s >= 0, "leave_window_s", f"must be >= 0 s, got {self.leave_window_s}")
        require(self.min_dwell_s >= 0, "min_dwell_s", f"must be >= 0 s, got {self.min_dwell_s}")
        require(
            self.finish_microstep_max_s >= 0,
            "finish_microstep_max_s",
            f"must be >= 0 s, got {self.finish_microstep_max_s}",
        )
        require(
            self.async_split in ASYNC_SPLITS,
            "async_split",
            f"must be one of {', '.join(ASYNC_SPLITS)}; got {self.async_split!r}",
        )
        require(
            self.leave_rule in LEAVE_RULES,
            "leave_rule",
            f"must be one of {', '.join(LEAVE_RULES)}; got {self.leave_rule!r}",
        )
        require(
            self.admission in ADMISSION, "admission", f"must be one of {', '.join(ADMISSION)}; got {self.admission!r}"
        )
        require(
            self.microstep_tokens >= 0,
            "microstep_tokens",
            f"must be >= 0 (0 = one group per micro-step), got {self.microstep_tokens}",
        )
        require(
            self.async_train_cells >= 0,
            "async_train_cells",
            f"must be >= 0 (0 = sized by async_split), got {self.async_train_cells}",
        )

    @property
    def round_trip_s(self) -> float:
        """Cost of leaving rollout and coming back, seconds."""
        return self.rollout_to_train_s + self.train_to_rollout_s
