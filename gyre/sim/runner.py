"""Run the modes on one workload and cluster, and the sensitivity sweeps; returns plain data."""

from dataclasses import replace

from gyre.sim.config import SimConfig
from gyre.sim.engine import Simulation
from gyre.sim.result import ModeResult, ideal_lower_bound_s, speedups

SWITCH_COST_SCALES = (0.5, 1.0, 2.0, 4.0)
"""Multiples of the seed's measured switch costs for the sensitivity table."""
TAIL_SCALES = (0.5, 1.0, 1.5, 2.0)
"""Multiples of the profile's duration-tail sigma for the sensitivity table."""


def run_modes(sim: SimConfig, modes=None, switch_scale: float = 1.0, tail_scale: float = 1.0) -> list[ModeResult]:
    """Simulate each mode on the same executions; the scheduler config differs only in `mode`."""
    losses = ((sim.lose_cell, sim.lose_at_h * 3600),) if sim.lose_cell else ()
    sched = replace(
        sim.scheduler,
        rollout_to_train_s=sim.scheduler.rollout_to_train_s * switch_scale,
        train_to_rollout_s=sim.scheduler.train_to_rollout_s * switch_scale,
    )
    return [
        Simulation(sim.profile, sim.preset, replace(sched, mode=m), sim.num_steps, seed=sim.seed,
                   tick_s=sim.tick_s, tail_scale=tail_scale, losses=losses).run()
        for m in (modes or sim.modes)
    ]


def summarize(sim: SimConfig, results: list[ModeResult]) -> dict:
    """Per mode time, ratio to the ideal lower bound and idle fractions; elastic's speedups."""
    ideal = ideal_lower_bound_s(results)
    return {
        "profile": sim.profile.name,
        "preset": sim.preset.name,
        "num_steps": sim.num_steps,
        "executions_per_step": sim.profile.executions_per_step,
        "ideal_h": round(ideal / 3600, 3),
        "critical_path_h": round(results[0].critical_path_s / 3600, 3),
        "modes": {r.mode: r.summary(ideal) for r in results},
        "speedup": speedups(results),
    }


def sensitivity(sim: SimConfig) -> dict:
    """Elastic's speedups as switch costs grow and as the duration tail thickens.

    async never switches, so one async run per tail serves every switch-cost row.
    """
    modes = [m for m in ("elastic", "async", "colocate") if m in sim.modes]
    base_async = run_modes(sim, modes=["async"]) if "async" in modes else []
    switch_rows = []
    for k in SWITCH_COST_SCALES:
        res = run_modes(sim, modes=[m for m in modes if m != "async"], switch_scale=k) + base_async
        switch_rows.append({"switch_cost_scale": k, **speedups(res), "elastic_h": _hours(res, "elastic")})
    tail_rows = []
    for k in TAIL_SCALES:
        res = run_modes(sim, modes=modes, tail_scale=k)
        tail_rows.append({"tail_scale": k, **speedups(res), "elastic_h": _hours(res, "elastic")})
    return {"switch_cost": switch_rows, "tail": tail_rows}


def _hours(results: list[ModeResult], mode: str) -> float | None:
    return next((round(r.total_s / 3600, 2) for r in results if r.mode == mode), None)
