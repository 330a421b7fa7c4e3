"""What one simulated mode produced, and the comparisons between modes (pure)."""

from dataclasses import dataclass, field


@dataclass
class CellStats:
    """One cell's account over the run."""

    index: int
    is_core: bool
    gen_tokens: float = 0.0
    train_busy_s: float = 0.0
    switch_s: float = 0.0
    switches: int = 0
    idle_fraction: float = 0.0
    """1 - (training compute + rollout use) / run time; rollout use is the larger of tokens at full
    cell throughput and session-slot occupancy."""
    timeline: list[tuple[float, str]] = field(default_factory=list)
    """(time_s, role) at every role or switching-state change."""
    rollout_use_s: float = 0.0
    """Rollout compute: decode and prefill at the cell's throughput, seconds (its GPU KV may bind
    first: at long contexts a cell is full well below its decode throughput)."""

    def role_busy(self, total_s: float) -> dict[str, tuple[float, float]]:
        """Per role: (share of the run in it, busy fraction while in it: micro-steps computed in
        train, decode and prefill compute in rollout); switching counts in its own role, never busy."""
        spans: dict[str, float] = {}
        marks = self.timeline + [(total_s, "")]
        for (t0, role), (t1, _) in zip(marks, marks[1:]):
            spans[role] = spans.get(role, 0.0) + t1 - t0
        busy = {"train": self.train_busy_s, "rollout": self.rollout_use_s}
        return {role: (t / total_s, busy.get(role, 0.0) / t if t else 0.0) for role, t in spans.items() if t > 0}


@dataclass
class ModeResult:
    """One mode's run."""

    mode: str
    total_s: float
    step_times_s: list[float]
    cells: list[CellStats]
    work_node_s: float
    """Decode (at `decode_tok_s_per_node`) and prefill at full node throughput plus training compute of
    the executions the steps trained or excluded, node-seconds."""
    num_nodes: int
    levels: list[tuple[float, int]]
    """(time_s, waterlevel) sampled every tick."""
    num_switches: int
    num_timeouts: int
    num_excluded: int
    async_train_cells: int | None = None
    num_blocked: int = 0
    """Model calls that found no serving cell and waited (only colocate's training phase should)."""
    max_staleness: int = 0
    """Largest (training step - start version) of any trained sample."""
    critical_path_s: float = 0.0
    """Latency bound of this workload: see `critical_path_s()`."""
    prefill_tokens: float = 0.0
    """Tokens prefilled: every call's new prompt tokens plus recomputed context."""
    recompute_tokens: float = 0.0
    """Of `prefill_tokens`, context recomputed because its KV was evicted and not offloaded."""
    rollout_work_s: float = 0.0
    """Decode + prefill of the executions the steps needed, at the whole cluster's throughput, s."""
    train_work_s: float = 0.0
    """Training of those executions at the whole cluster's throughput, seconds."""
    rollout_latency_s: float = 0.0
    """Mean per step of its longest execution on an unloaded engine: the least rollout time a
    step takes, however many cells serve it."""
    budget_hit_fraction: float = 0.0
    """Share of started executions that ran out of their time budget."""
    budget_hit_unloaded: float = 0.0
    """Share of the workload's executions whose unloaded duration at this model's session speed
    reaches the budget (the profile's budget-hit rate calibrated to the model, before queueing)."""
    train_tok_s_per_node: float = 0.0
    prefill_tok_s_per_node: float = 0.0
    reload_tokens: float = 0.0
    """Context reloaded from the offload tier, tokens."""
    num_stale_dropped: int = 0
    """Executions trained nowhere because every span of theirs fell outside the staleness bound."""
    masked_fraction: float = 0.0
    """Share of trained executions' segments masked out of the loss as older than the bound."""
    startup_bound_s: float = 0.0
    """Work / capacity counting that nothing trains before the first group can be ready: see
    `startup_bound_s()`."""
    trained_tokens: float = 0.0
    """Tokens the N steps trained: a mode whose executions hit the budget more trains less, so
    comparing times is fair only beside it."""

    @property
    def own_bound_s(self) -> float:
        """max(this run's work / capacity, its critical path, its startup bound): how close the
        policy came to what its own executions allowed, whatever work it cut at the budget."""
        return max(self.work_node_s / self.num_nodes, self.critical_path_s, self.startup_bound_s)

    def summary(self, ideal_s: float, bound_s: float = 0.0) -> dict:
        """JSON-ready figures; `ideal_s` (work / capacity) and `bound_s` (the tighter bound,
        default max(ideal_s, this run's critical path)) are shared by all modes."""
        bound_s = bound_s or max(ideal_s, self.critical_path_s)
        return {
            "mode": self.mode,
            "time_h": round(self.total_s / 3600, 3),
            "ratio_to_ideal": round(self.total_s / ideal_s, 3),
            "ratio_to_bound": round(self.total_s / bound_s, 3),
            "idle_fraction": [round(c.idle_fraction, 3) for c in self.cells],
            "role_busy": [
                {role: [round(share, 3), round(busy, 3)] for role, (share, busy) in c.role_busy(self.total_s).items()}
                for c in self.cells
            ],
            "switches": self.num_switches,
            "timeouts": self.num_timeouts,
            "excluded": self.num_excluded,
            "async_train_cells": self.async_train_cells,
            "blocked_calls": self.num_blocked,
            "max_staleness": self.max_staleness,
            "prefill_mtok": round(self.prefill_tokens / 1e6, 1),
            "recompute_mtok": round(self.recompute_tokens / 1e6, 1),
            "budget_hit": round(self.budget_hit_fraction, 3),
            "trained_mtok": round(self.trained_tokens / 1e6),
            "ratio_to_own_bound": round(self.total_s / self.own_bound_s, 3),
            "reload_mtok": round(self.reload_tokens / 1e6, 1),
            "stale_dropped": self.num_stale_dropped,
            "masked_fraction": round(self.masked_fraction, 3),
        }


def ideal_lower_bound_s(results: list[ModeResult]) -> float:
    """Total work / total capacity: the least work any mode did, spread over every node.

    Modes differ slightly in work (timeouts cut executions at different points), so the smallest
    is the bound no mode can beat on this workload.
    """
    return min(r.work_node_s for r in results) / results[0].num_nodes


def critical_path_s(
    groups: list[list[tuple[float, float]]], staleness: int, optimizer_step_s: float, early_admission: bool = False
) -> float:
    """Latency lower bound of the run, whatever the capacity, with each step's training after
    its groups are ready.

    Args:
        groups: per step, per group: (the least time from the step's admission to the group
            being ready, the group's training time on every cell at once). The first is 0 where
            a group need not wait for its own step's executions (first_ready batching).

    Why no run beats it (each quantity below is a lower bound of the run's, by induction over
    steps, and every formula is non-decreasing in its inputs):
    - admission: step k's batch starts once optimizer step k - s - 1 is applied (with
      `early_admission`: once its batch is ready); time 0 for k <= s.
    - a group is ready no earlier than admission + its longest execution's duration on an
      unloaded engine, capped at the time budget: an execution never decodes faster than one
      session's speed, its tool calls take their drawn time, and it starts after admission.
    - a group's micro-steps exist only once it is ready, and are claimable only while its step is
      the current one (MicroStepQueue.claim): after optimizer step k - 1 is applied. So each
      group is a job released at max(applied k - 1, its ready time).
    - all cells together train at most the cluster's training throughput, so the step's training
      takes at least its jobs on one machine of that speed, preemptive and divisible: the
      release-order schedule, whose end is the least possible.
    - the optimizer step waits for the whole batch and the last micro-step, and steps are
      sequential.
    """
    applied: list[float] = []
    ready: list[float] = []
    for k, step in enumerate(groups):
        gate = ready if early_admission else applied
        admitted = gate[k - staleness - 1] if k > staleness else 0.0
        previous = applied[-1] if applied else 0.0
        ready.append(admitted + max((u for u, _ in step), default=0.0))
        done = max(previous, ready[-1])
        t = previous
        for release, train_s in sorted((max(previous, admitted + u), p) for u, p in step):
            t = max(t, release) + train_s
        applied.append(max(done, t) + optimizer_step_s)
    return applied[-1] if applied else 0.0


def startup_bound_s(
    first_release_s: float, train_s: float, rollout_s: tuple[float, float], first_rollout_s: tuple[float, float]
) -> float:
    """Work / capacity, knowing that no cell can train before `first_release_s`.

    Args:
        first_release_s: the least unloaded duration (capped at the budget) of the longest
            execution of any group of the batches admitted at time 0 (steps 0..s).
        train_s: the run's training on every cell at once, seconds.
        rollout_s: the run's rollout on the whole cluster, (decode + prefill compute, KV
            token-seconds / GPU KV), seconds; it takes at least the larger.
        first_rollout_s: the same for the executions of the batches admitted at time 0.

    Why no run beats it: training needs a ready group of the current step (MicroStepQueue), none
    is ready before `first_release_s`, and only steps 0..s are admitted before then (step s + 1
    waits for step 0's optimizer step, or with early admission its batch). So before
    `first_release_s` the cluster does at most that long of rollout, and only theirs; after it,
    every node either serves or trains (as in work / capacity), so the rest of each rollout
    resource and all the training follow it.
    """
    rest = max(0.0, *(total - min(first_release_s, first) for total, first in zip(rollout_s, first_rollout_s)))
    return first_release_s + rest + train_s


def tighter_bound_s(results: list["ModeResult"]) -> float:
    """max(work / capacity, critical path, startup bound): the bound every mode is judged against.
    Each is the least over the runs (a mechanism that admits earlier, or a run that trains less,
    lowers it)."""
    return max(
        ideal_lower_bound_s(results), min(r.critical_path_s for r in results), min(r.startup_bound_s for r in results)
    )


def regime(results: list["ModeResult"]) -> dict:
    """What bounds this workload: training vs rollout work per step (T/R), the 1 + 2T/R ceiling
    on any scheduler's gain over Colocate, and both lower bounds."""
    r = min(results, key=lambda x: x.work_node_s)
    steps = max(1, len(r.step_times_s))
    t = r.train_work_s / steps  # one step's training on every node
    rollout = max(r.rollout_work_s / steps, r.rollout_latency_s)  # compute, or its longest execution
    t_over_r = t / rollout if rollout else 0.0
    return {
        "train_h_per_step": round(t / 3600, 3),
        "rollout_h_per_step": round(rollout / 3600, 3),
        "t_over_r": round(t_over_r, 3),
        "ceiling_vs_colocate": round(1 + 2 * t_over_r, 3),
        "ideal_h": round(ideal_lower_bound_s(results) / 3600, 3),
        "critical_path_h": round(min(x.critical_path_s for x in results) / 3600, 3),
        "startup_h": round(min(x.startup_bound_s for x in results) / 3600, 3),
        "bound_h": round(tighter_bound_s(results) / 3600, 3),
        "budget_hit_unloaded": round(r.budget_hit_unloaded, 3),
        "train_tok_s_per_node": round(r.train_tok_s_per_node),
        "prefill_tok_s_per_node": round(r.prefill_tok_s_per_node),
    }


def speedups(results: list[ModeResult]) -> dict[str, float]:
    """Elastic's speedup over each other mode that ran (time_other / time_elastic)."""
    by_mode = {r.mode: r.total_s for r in results}
    if "elastic" not in by_mode:
        return {}
    return {f"vs_{m}": round(t / by_mode["elastic"], 3) for m, t in by_mode.items() if m != "elastic"}
