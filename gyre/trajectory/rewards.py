"""Reward rules and group-normalised (GRPO) advantages; every exclusion carries a reason.

An execution is scored only by its evaluator: a finished run by its final workspace, a timed-out
run by its preserved workspace (partial credit). An evaluator crash or infrastructure error says
nothing about the policy, so the execution is excluded, never scored 0. A run that exhausted its
overall time budget (timed_out, the time before a restart included) is trained only with the
partial credit its workspace earns; without a valid reward (no model call, no score, or a score
that credits nothing) it is discarded as budget_exhausted: a run cut off before it got anywhere
says how long it took, not how good it was (the seed's rule).
"""

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

from gyre.trajectory.config import TrajectoryConfig

HARNESS_OUTCOMES = ("finished", "timed_out")
"""How a harness run can end; the evaluator scores the workspace of either."""
LedgerState = Literal["queued", "running", "finished", "timed_out", "excluded", "trained"]
"""An execution's ledger states (gyre.coordinator.ledger; its ExecutionState events), in the order a
normal life goes through them."""
LEDGER_STATES: tuple[LedgerState, ...] = get_args(LedgerState)
OUTCOMES = (*HARNESS_OUTCOMES, "evaluator_error", "budget_exhausted")
"""finished: the harness exited; timed_out: its time budget ended it (workspace preserved);
evaluator_error: the evaluator crashed or its infrastructure failed; budget_exhausted: the overall
time budget ran out before a valid reward existed."""


@dataclass(frozen=True)
class Evaluation:
    """What became of one execution and what its evaluator said."""

    outcome: str
    """One of OUTCOMES."""
    score: float | None = None
    """Evaluator score of the (final or preserved) workspace, usually in [0, 1] (a Harbor verifier may
    write any finite number: advantages are normalised per group); None if there is none."""
    detail: str = ""
    """Free text for logs (the evaluator's error, ...)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Named numbers the evaluator reported beside the score (a Harbor reward.json's other keys)."""

    def __post_init__(self):
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome {self.outcome!r} is not one of {', '.join(OUTCOMES)}")
        if self.score is not None and not math.isfinite(self.score):
            raise ValueError(f"score must be a finite number, got {self.score}")


def settle_budget(evaluation: Evaluation) -> Evaluation:
    """A timed-out run's evaluation by the seed's rule: kept when its preserved workspace earns
    partial credit (a score above 0), else budget_exhausted (no valid reward: discarded), its
    score and detail kept in the detail. Any other evaluation is returned unchanged."""
    if evaluation.outcome != "timed_out" or (evaluation.score is not None and evaluation.score > 0):
        return evaluation
    credit = "no score" if evaluation.score is None else f"no partial credit (score {evaluation.score:g})"
    detail = f"stopped at its time budget with {credit}: {evaluation.detail}".rstrip(": ")
    return Evaluation("budget_exhausted", None, detail, evaluation.metrics)


def reward_of(evaluation: Evaluation) -> tuple[float | None, str | None]:
    """(reward, None) for a scorable execution, else (None, exclusion reason); a timed-out one
    without partial credit is budget_exhausted (settle_budget), wherever its evaluation came from."""
    evaluation = settle_budget(evaluation)
    if evaluation.outcome in HARNESS_OUTCOMES:
        if evaluation.score is None:
            return None, "no_score"
        return float(evaluation.score), None
    return None, evaluation.outcome


def unscored_reason(exit_code: int, made_model_calls: bool, timed_out: bool = False) -> str | None:
    """Why an ended harness run is excluded before its workspace is scored, or None to score it.

    Without a model call the policy never acted, so the workspace says nothing about it: the run
    was stopped at its time budget before one ended (budget_exhausted), or the harness crashed at
    once (harness_failed) or did the work itself (no_model_calls). The coordinator and `gyre-task
    run` both apply this rule.
    """
    if made_model_calls:
        return None
    if timed_out:
        return "budget_exhausted"
    return "harness_failed" if exit_code != 0 else "no_model_calls"


def group_advantages(rewards: dict[str, float], config: TrajectoryConfig) -> tuple[dict[str, float], str | None]:
    """GRPO advantages of one task group's valid executions, or ({}, reason) to drop the group.

    A_i = (r_i - mean(r)) / (std(r) + eps) with the population std (or without the division when
    config.normalize_std is False). Reasons: group_too_small, uniform_group.
    """
    if len(rewards) < config.min_group_size:
        return {}, "group_too_small"
    r = np.array(list(rewards.values()), dtype=np.float64)
    if config.drop_uniform_groups and np.ptp(r) == 0.0:
        return {}, "uniform_group"
    centred = r - r.mean()
    if config.normalize_std:
        centred = centred / (r.std() + config.std_eps)
    return dict(zip(rewards.keys(), centred.tolist())), None
