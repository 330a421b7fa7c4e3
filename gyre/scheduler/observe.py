"""The one Observation builder (pure): the live coordinator and the simulator both call it.

Each side measures the same quantities in its own way (the coordinator from the proxy, its steps
and the trainer's throughput; the simulator from its virtual clock) and this function turns them
into what the policy sees, so the two can never disagree on what a field means.
"""

from collections.abc import Sequence
from typing import Protocol

from gyre.scheduler.cells import Cell
from gyre.scheduler.policy import CellView, Observation


class ReadyWork(Protocol):
    """The training work the policy sees: the coordinator's steps (gyre.coordinator.training) live,
    the micro-step queue (gyre.scheduler.streaming.MicroStepQueue) in the simulator."""

    def ready_tokens(self) -> int:
        """Tokens of the current step ready and not yet trained."""

    def ready_tokens_ahead(self) -> int:
        """Tokens already placed in later steps."""

    def batch_ready(self) -> bool:
        """Every group of the current step is ready or excluded."""

    def step_started(self) -> bool:
        """Training of the current step has begun."""


def make_observation(
    now_s: float,
    cells: Sequence[Cell],
    sessions: Sequence[int],
    max_sessions: Sequence[int],
    gen_tok_s: Sequence[float] | None,
    *,
    queued: int,
    queued_ahead: int,
    running: int,
    running_ahead: int,
    work: ReadyWork,
    train_tok_s: float,
    optimizing: bool,
    gen_demand_tok_s: float = 0.0,
    pooled_sessions: int = 0,
) -> Observation:
    """What the policy sees now.

    Args:
        sessions, max_sessions, gen_tok_s: per cell (index order): live sessions it serves, how
            many it can serve, generation throughput it sustains (None: not measured; then
            `gen_demand_tok_s` must be 0 and only sessions bound rollout).
        work: ready training work and the batch state of the current step.
        train_tok_s: training throughput of one satellite cell, tokens/s (measured or configured).
        optimizing: the core is applying the current step's optimizer step.
        queued_ahead, running_ahead: of those, executions of later steps (demand: pro rata).
    """
    if gen_tok_s is None:
        if gen_demand_tok_s:
            raise ValueError("decode demand without the cells' decode throughput")
        gen_tok_s = [CellView.gen_tok_s] * len(cells)  # decode never binds: no demand to compare
    views = tuple(
        CellView(
            index=c.index,
            role=c.role,
            is_core=c.is_core,
            in_step=c.step is not None,
            since_s=c.since_s,
            sessions=n,
            max_sessions=m,
            gen_tok_s=g,
        )
        for c, n, m, g in zip(cells, sessions, max_sessions, gen_tok_s)
    )
    return Observation(
        now_s=now_s,
        cells=views,
        queued=queued,
        queued_ahead=queued_ahead,
        running=running,
        running_ahead=running_ahead,
        pooled_sessions=pooled_sessions,
        gen_demand_tok_s=gen_demand_tok_s,
        gen_demand_ahead_tok_s=gen_demand_tok_s * running_ahead / max(running, 1),
        ready_train_s=work.ready_tokens() / train_tok_s,
        ready_ahead_train_s=work.ready_tokens_ahead() / train_tok_s,
        batch_ready=work.batch_ready(),
        step_open=work.step_started() or optimizing,
    )
