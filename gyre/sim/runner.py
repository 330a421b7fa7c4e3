"""Run the modes on one workload and cluster, and the sensitivity sweeps; returns plain data."""

from dataclasses import replace

from gyre.sim.config import SimConfig
from gyre.sim.engine import Simulation
from gyre.sim.result import ModeResult, ideal_lower_bound_s, regime, speedups, tighter_bound_s

SWITCH_COST_SCALES = (0.5, 1.0, 2.0, 4.0)
"""Multiples of the seed's measured switch costs for the sensitivity table."""
TAIL_SCALES = (0.5, 1.0, 1.5, 2.0)
"""Multiples of the profile's duration-tail sigma for the sensitivity table."""
BUDGET_SCALES = (0.5, 1.0, 1.5, 2.0)
"""Multiples of the profile's time budget: the budget-hit rate swept, not assumed."""


def run_modes(sim: SimConfig, modes=None, switch_scale: float = 1.0, tail_scale: float = 1.0) -> list[ModeResult]:
    """Simulate each mode on the same executions; the scheduler config differs only in `mode`."""
    losses = ((sim.lose_cell, sim.lose_at_h * 3600),) if sim.lose_cell else ()
    sched = replace(
        sim.scheduler,
        rollout_to_train_s=sim.scheduler.rollout_to_train_s * switch_scale,
        train_to_rollout_s=sim.scheduler.train_to_rollout_s * switch_scale,
    )
    return [
        Simulation(
            sim.profile,
            sim.preset,
            replace(sched, mode=m),
            sim.num_steps,
            seed=sim.seed,
            tick_s=sim.tick_s,
            tail_scale=tail_scale,
            losses=losses,
            phase_s={k: v * switch_scale for k, v in sim.phase_s.items()},
        ).run()
        for m in (modes or sim.modes)
    ]


MECHANISMS = {
    "value_leave": {"leave_rule": "value"},
    "rebalance": {"rebalance_on_return": True},
    "token_microsteps": {"microstep_tokens": 1_000_000},
    "staleness_admission": {"admission": "staleness"},
}
"""Each policy mechanism's switch (gyre.scheduler.config), measured alone and all together."""


def summarize(sim: SimConfig, results: list[ModeResult]) -> dict:
    """Per mode time, ratio to both bounds and idle fractions; the regime; elastic's speedups."""
    ideal = ideal_lower_bound_s(results)
    bound = tighter_bound_s(results)
    return {
        "profile": sim.profile.name,
        "preset": sim.preset.name,
        "num_steps": sim.num_steps,
        "executions_per_step": sim.profile.executions_per_step,
        "ideal_h": round(ideal / 3600, 3),
        "critical_path_h": round(min(r.critical_path_s for r in results) / 3600, 3),
        "regime": regime(results),
        "modes": {r.mode: r.summary(ideal, bound) for r in results},
        "speedup": speedups(results),
    }


def _run(sim: SimConfig, label: str, **changes) -> tuple[str, ModeResult]:
    preset = {k[7:]: v for k, v in changes.items() if k.startswith("preset_")}
    sched = {k: v for k, v in changes.items() if not k.startswith("preset_")}
    s = replace(sim, scheduler=replace(sim.scheduler, **sched), preset=replace(sim.preset, **preset))
    (r,) = run_modes(s, modes=[sched.get("mode", sim.scheduler.mode)])
    return label, r


def baselines(sim: SimConfig) -> list[tuple[str, ModeResult]]:
    """Elastic and every baseline as a user would run it, on the same executions: async with the
    even split, with each pool size (the best is the oracle a sweep finds), with the host tier
    scoped to its rollout pool; colocate at matched staleness and synchronous (s=0)."""
    runs = [_run(sim, "elastic", mode="elastic"), _run(sim, "async even", mode="async", async_split="even")]
    sweep = [_run(sim, f"async {k} train", mode="async", async_train_cells=k) for k in range(1, sim.preset.num_cells)]
    best = min(sweep, key=lambda lr: lr[1].total_s)
    runs.append((f"async oracle ({best[1].async_train_cells} train)", best[1]))
    runs.append(
        _run(sim, "async even, tier per role", mode="async", async_split="even", preset_host_tier_scope="rollout_pool")
    )
    runs.append(_run(sim, f"colocate s={sim.scheduler.staleness}", mode="colocate"))
    if sim.scheduler.staleness:
        runs.append(_run(sim, "colocate s=0 (sync)", mode="colocate", staleness=0))
    return runs + [(f"  sweep: {label}", r) for label, r in sweep]


def mechanisms(sim: SimConfig) -> list[tuple[str, ModeResult]]:
    """Elastic with every mechanism off, each alone, those that train the same data together (all
    but staleness admission, which masks spans), and all together (same executions)."""
    off = {"leave_rule": "waterlevel", "rebalance_on_return": False, "microstep_tokens": 0, "admission": "step"}
    runs = [_run(sim, "elastic, none", mode="elastic", **off)]
    for name, switch in MECHANISMS.items():
        runs.append(_run(sim, f"elastic + {name}", mode="elastic", **{**off, **switch}))
    neutral = {k: v for name, switch in MECHANISMS.items() if name != "staleness_admission" for k, v in switch.items()}
    runs.append(_run(sim, "elastic, all but admission", mode="elastic", **neutral))
    everything = {k: v for switch in MECHANISMS.values() for k, v in switch.items()}
    runs.append(_run(sim, "elastic, all", mode="elastic", **everything))
    return runs


def label_table(runs: list[tuple[str, ModeResult]]) -> dict:
    """Each labelled run's time, ratio to the tighter bound shared by all of them and to its own
    (the same bound on its own work), elastic's speedup over it (the first run is the reference)
    and what it cost in training data: budget hits, tokens trained, spans masked."""
    results = [r for _, r in runs]
    bound = tighter_bound_s(results)
    ref = results[0].total_s
    rows = [
        {
            "run": label,
            "time_h": round(r.total_s / 3600, 3),
            "ratio_to_bound": round(r.total_s / bound, 3),
            "first_over_it": round(r.total_s / ref, 3),
            "switches": r.num_switches,
            "ratio_to_own_bound": round(r.total_s / r.own_bound_s, 3),
            "trained_mtok": round(r.trained_tokens / 1e6),
            "budget_hit": round(r.budget_hit_fraction, 3),
            "masked_fraction": round(r.masked_fraction, 3),
            "stale_dropped": r.num_stale_dropped,
            "max_staleness": r.max_staleness,
        }
        for label, r in runs
    ]
    return {"regime": regime(results), "rows": rows}


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
    budget_rows = []
    for k in BUDGET_SCALES:
        res = run_modes(replace(sim, profile=replace(sim.profile, timeout_s=sim.profile.timeout_s * k)), modes=modes)
        budget_rows.append(
            {
                "budget_scale": k,
                **speedups(res),
                "elastic_h": _hours(res, "elastic"),
                "budget_hit_unloaded": round(res[0].budget_hit_unloaded, 3),
                "budget_hit": {r.mode: round(r.budget_hit_fraction, 3) for r in res},
            }
        )
    return {"switch_cost": switch_rows, "tail": tail_rows, "budget": budget_rows}


def _hours(results: list[ModeResult], mode: str) -> float | None:
    return next((round(r.total_s / 3600, 2) for r in results if r.mode == mode), None)
