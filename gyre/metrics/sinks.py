"""Scalar views of events: which figures each event adds (pure), and the TensorBoard / W&B writers.

Each event gives at most one `Scalars` row on one x axis: `step` (optimizer step: losses, rewards,
tokens naive / capped / deduplicated and what the cap and dedup saved), `elapsed_s` (seconds since
the run's first event: the cluster samples with calls/s, tokens/s, outcomes, exclusions),
`switch` (the n-th role switch: its phases), `version` (weight publishes), `micro_step`.
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gyre.metrics.config import MetricsConfig
from gyre.metrics.events import (
    ROLES,
    Checkpoint,
    Event,
    HeldOutResult,
    MicroStepEvent,
    ObservationEvent,
    OptimizerStep,
    RoleSwitchEvent,
    WeightPublish,
)
from gyre.metrics.state import RunState, mean_se

_LOSS_FIELDS = (
    "loss",
    "clip_fraction",
    "truncated_fraction",
    "ratio_mean",
    "logprob_gap_mean",
    "kl_mean",
    "entropy_mean",
    "grad_norm",
    "num_executions",
)
_TOKEN_FIELDS = (
    "targets_naive",
    "targets_capped",
    "targets_dedup",
    "seq_tokens_naive",
    "seq_tokens_capped",
    "seq_tokens_packed",
    "seq_tokens_tree",
)


@dataclass(frozen=True)
class Scalars:
    axis: str
    step: int
    values: dict[str, float]


def make_scalars(e: Event, state: RunState) -> Scalars | None:
    """The figures event `e` adds, given the state that already folded it (None: it adds none)."""
    if isinstance(e, OptimizerStep):
        values = {f"train/{k}": getattr(e, k) for k in _LOSS_FIELDS if getattr(e, k) is not None}
        values |= {f"tokens/{k}": getattr(e, k) for k in _TOKEN_FIELDS}
        values["tokens/saved_by_cap"] = 1 - e.targets_capped / e.targets_naive if e.targets_naive else 0.0
        values["tokens/saved_by_dedup"] = 1 - e.targets_dedup / e.targets_capped if e.targets_capped else 0.0
        values |= {"train/step_s": e.seconds, "reward/mean": e.reward_mean, "reward/std": e.reward_std}
        return Scalars("step", e.step, values)
    if isinstance(e, ObservationEvent):
        calls_s, tokens_s = state.rates()
        values = {
            "cluster/queued": e.queued,
            "cluster/running": e.running,
            "cluster/waterlevel": e.waterlevel,
            "cluster/sessions": sum(e.sessions),
            "rollout/calls_per_s": calls_s,
            "rollout/output_tokens_per_s": tokens_s,
            "failures/total": sum(state.failures.values()),
        }
        values |= {f"cluster/cells_{r}": sum(x == r for x in e.roles) for r in ROLES}
        values |= {f"executions/{k}": n for k, n in state.outcomes().items()}
        values |= {f"exclusions/{k}": n for k, n in state.exclusions.items()}
        return Scalars("elapsed_s", int(e.t - state.t_first), values)
    if isinstance(e, RoleSwitchEvent):
        values = {f"switch/{p}_s": s for p, s in e.phases.items()} | {"switch/total_s": e.t - e.t_start}
        return Scalars("switch", state.num_switches, values)
    if isinstance(e, WeightPublish):
        return Scalars("version", e.version, {"publish/seconds": e.seconds, "publish/num_engines": e.num_engines})
    if isinstance(e, Checkpoint):
        return Scalars("step", e.step, {"checkpoint/seconds": e.seconds})
    if isinstance(e, HeldOutResult) and e.reward is not None:  # the running mean at this version
        mean, se = mean_se(state.held_out[e.version])
        return Scalars(
            "version", e.version, {"eval/reward_mean": mean} | ({"eval/reward_se": se} if se is not None else {})
        )
    if isinstance(e, MicroStepEvent):
        return Scalars(
            "micro_step",
            state.num_micro_steps,
            {"train/micro_step_tokens_per_s": e.tokens / e.seconds if e.seconds > 0 else 0.0},
        )
    return None


class MetricsSink(Protocol):
    """Where scalars go (TensorBoard, W&B); gyre.metrics.monitor.RunMonitor writes every sink it was configured with."""

    def write(self, e: Event, scalars: Scalars) -> None:
        """Log the figures `e` added (`scalars.values` against `scalars.axis` = `scalars.step`)."""

    def write_images(self, paths: list[Path], step: int) -> None:
        """Log the pictures the monitor has just redrawn in the run directory (`step`: the last optimizer step)."""

    def close(self) -> None:
        """Flush and release (the run is over)."""


class TensorBoardSink(MetricsSink):
    """TensorBoard event files under `log_dir` (`tensorboard --logdir <run_dir>/tensorboard`)."""

    def __init__(self, log_dir: str | os.PathLike):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir), flush_secs=30)

    def write(self, e: Event, scalars: Scalars) -> None:
        for tag, value in scalars.values.items():
            self._writer.add_scalar(tag, value, scalars.step, walltime=e.t)

    def write_images(self, paths: list[Path], step: int) -> None:
        """Scalars only: the pictures are already files beside the event files."""

    def close(self) -> None:
        self._writer.close()


class WandbSink(MetricsSink):
    """A Weights & Biases run; each tag is plotted against its own axis (`define_metric`)."""

    def __init__(self, run_dir: str | os.PathLike, cfg: MetricsConfig, name: str):
        import wandb

        self._run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity or None,
            mode=cfg.wandb_mode,
            dir=str(run_dir),
            name=name,
            reinit="finish_previous",
        )
        self._defined: set[str] = set()

    def write(self, e: Event, scalars: Scalars) -> None:
        self._log(scalars.values, scalars.axis, scalars.step)

    def write_images(self, paths: list[Path], step: int) -> None:
        """Each picture as a `wandb.Image` under `figures/<name>` (one per redraw: the run page's slider)."""
        import wandb

        self._log({f"figures/{p.stem}": wandb.Image(str(p)) for p in paths}, "step", step)

    def _log(self, values: dict, axis: str, step: int) -> None:
        for tag in values.keys() - self._defined:
            self._run.define_metric(tag, step_metric=axis)
            self._defined.add(tag)
        self._run.log({**values, axis: step})

    def close(self) -> None:
        self._run.finish()
