"""Rendering of simulator results: text tables and timeline panels (pure; gyre.metrics.plots draws them)."""

from gyre.metrics.state import Span, TimelinePanel
from gyre.sim.result import ModeResult


def format_regime(reg: dict) -> str:
    """One line: what bounds the workload, and the most any scheduler can gain over Colocate."""
    return (
        f"regime: T/R {reg['t_over_r']:.3f} (per step: training {reg['train_h_per_step']:.2f} h on every node / "
        f"rollout {reg['rollout_h_per_step']:.2f} h, its compute or its longest execution), ceiling over "
        "Colocate 1 + 2T/R = "
        f"{reg['ceiling_vs_colocate']:.2f}x; bounds: work/capacity {reg['ideal_h']:.2f} h, critical path "
        f"{reg['critical_path_h']:.2f} h, startup {reg['startup_h']:.2f} h, tighter {reg['bound_h']:.2f} h; "
        f"budget hit {reg['budget_hit_unloaded']:.1%} "
        f"unloaded at this model's speed; train {reg['train_tok_s_per_node']} "
        f"tok/s/node, prefill {reg['prefill_tok_s_per_node']} tok/s/node (FLOPs x MFU unless measured)"
    )


def format_labels(table: dict) -> str:
    """Labelled runs (baselines or mechanisms) against the tighter bound shared by all of them."""
    lines = [
        format_regime(table["regime"]),
        f"{'run':<32} {'time h':>8} {'/bound':>7} {'/own':>6} {'x first':>8} {'switches':>9} {'budget hit':>11}"
        f" {'trained Mtok':>13} {'masked':>7} {'dropped':>8}",
    ]
    for r in table["rows"]:
        lines.append(
            f"{r['run']:<32} {r['time_h']:>8.2f} {r['ratio_to_bound']:>7.3f} {r['ratio_to_own_bound']:>6.3f} "
            f"{r['first_over_it']:>8.3f} {r['switches']:>9} {r['budget_hit']:>11.1%} {r['trained_mtok']:>13} "
            f"{r['masked_fraction']:>7.1%} {r['stale_dropped']:>8}"
        )
    lines.append(
        "/bound: against the least work / capacity, critical path and startup bound of all runs above; "
        "/own: against this run's own (a run that cuts executions at the budget trains fewer tokens: "
        "it is not at equal work)"
    )
    return "\n".join(lines)


def format_modes(summary: dict) -> str:
    """Per-mode table: time, elastic's speedup over it, ratio to both bounds, per-cell idle."""
    lines = [
        f"workload {summary['profile']} on {summary['preset']}: {summary['num_steps']} steps x "
        f"{summary['executions_per_step']} executions",
        format_regime(summary["regime"]),
        f"{'mode':<9} {'time h':>9} {'elastic x':>10} {'/ideal':>7} {'/bound':>7} {'/own':>6} {'switches':>9} "
        f"{'timeouts':>9}"
        f" {'budget hit':>11} {'trained Mtok':>13}  idle per cell (core first)",
    ]
    elastic = summary["modes"].get("elastic")
    for mode, m in summary["modes"].items():
        sp = f"{m['time_h'] / elastic['time_h']:.3f}" if elastic else "-"
        idle = " ".join(f"{x:.2f}" for x in m["idle_fraction"])
        pools = f" (train pool {m['async_train_cells']})" if m["async_train_cells"] else ""
        if m["masked_fraction"] or m["stale_dropped"]:
            pools += f" [spans masked {m['masked_fraction']:.0%}, executions dropped {m['stale_dropped']}]"
        lines.append(
            f"{mode:<9} {m['time_h']:>9.2f} {sp:>10} {m['ratio_to_ideal']:>7.2f} {m['ratio_to_bound']:>7.2f} "
            f"{m['ratio_to_own_bound']:>6.2f} {m['switches']:>9} {m['timeouts']:>9} {m['budget_hit']:>11.1%} "
            f"{m['trained_mtok']:>13}  {idle}{pools}"
        )
        lines.append(
            f"{'':<9} per cell, share of the run in a role (busy in it): "
            + " | ".join(
                " ".join(
                    f"{role} {share:.2f} ({busy:.2f})"
                    for role, (share, busy) in cell.items()
                    if role in ("train", "rollout")
                )
                for cell in m["role_busy"]
            )
        )
    return "\n".join(lines)


def format_compare(rows: list[dict]) -> str:
    """The seed's table side by side with elastic's simulated speedup over each baseline variant
    (async even / oracle split / tier per role; colocate matched / s=0), its ratio to the bound."""
    head = (
        f"{'workload (seed)':<44} {'seed vs Async':>27} {'sim even':>10} {'oracle':>10} {'per-role':>10} "
        f"{'seed vs Colocate':>18} {'sim s=1':>10} {'s=0':>10} {'elastic/bound':>14}  elastic h  T/R"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['workload']:<44} {r['seed_vs_async']:>27} {r['vs_async_even']:>10} {r['vs_async_oracle']:>10} "
            f"{r['vs_async_per_role']:>10} {r['seed_vs_colocate']:>18} {r['vs_colocate']:>10} "
            f"{r['vs_colocate_s0']:>10} "
            f"{r['elastic_bound']:>14}  {r['sim_elastic_h']}  {r['t_over_r']}"
        )
    return "\n".join(lines)


def format_sensitivity(table: dict) -> str:
    """Speedup as switch cost grows and as the duration tail thickens."""
    lines = ["switch cost (x seed's 8.52 s / 3.46 s)   elastic h   vs async   vs colocate"]
    for r in table["switch_cost"]:
        lines.append(
            f"{r['switch_cost_scale']:>38.1f}x {r['elastic_h']:>10} {_g(r, 'vs_async'):>10} {_g(r, 'vs_colocate'):>13}"
        )
    lines.append("duration tail (x profile's sigma)        elastic h   vs async   vs colocate")
    for r in table["tail"]:
        lines.append(
            f"{r['tail_scale']:>38.1f}x {r['elastic_h']:>10} {_g(r, 'vs_async'):>10} {_g(r, 'vs_colocate'):>13}"
        )
    lines.append("time budget (x profile's)  budget hit unloaded   elastic h   vs async   vs colocate   hit per mode")
    for r in table.get("budget", []):
        hits = " ".join(f"{m} {h:.1%}" for m, h in r["budget_hit"].items())
        lines.append(
            f"{r['budget_scale']:>24.1f}x {r['budget_hit_unloaded']:>19.1%} {r['elastic_h']:>11} "
            f"{_g(r, 'vs_async'):>10} {_g(r, 'vs_colocate'):>13}   {hits}"
        )
    return "\n".join(lines)


def _g(row: dict, key: str) -> str:
    return f"{row[key]:.3f}" if key in row else "-"


def timeline_panels(results: list[ModeResult]) -> list[TimelinePanel]:
    """One timeline panel per mode (drawn by gyre.metrics.plots.draw_timelines, as live runs are)."""
    panels = []
    for r in results:
        lanes = []
        for c in r.cells:
            marks = c.timeline + [(r.total_s, "")]
            spans = [Span(t0, t1, role) for (t0, role), (t1, _) in zip(marks, marks[1:]) if t1 > t0]
            lanes.append(("core" if c.is_core else f"cell {c.index}", spans))
        panels.append(TimelinePanel(f"{r.mode}: {r.total_s / 3600:.1f} h", lanes, r.levels, 0.0, r.total_s))
    return panels
