"""Rendering of simulator results: text tables and timeline panels (pure; gyre.metrics.plots draws them)."""

from gyre.metrics.state import Span, TimelinePanel
from gyre.sim.result import ModeResult


def format_modes(summary: dict) -> str:
    """Per-mode table: time, elastic's speedup over it, ratio to the ideal bound, per-cell idle."""
    lines = [
        f"workload {summary['profile']} on {summary['preset']}: {summary['num_steps']} steps x "
        f"{summary['executions_per_step']} executions; ideal lower bound (work/capacity) {summary['ideal_h']:.2f} h, "
        f"latency bound (critical path) {summary['critical_path_h']:.2f} h",
        f"{'mode':<9} {'time h':>9} {'elastic x':>10} {'/ideal':>7} {'/bound':>7} {'switches':>9} {'timeouts':>9}"
        "  idle per cell (core first)",
    ]
    elastic = summary["modes"].get("elastic")
    for mode, m in summary["modes"].items():
        sp = f"{m['time_h'] / elastic['time_h']:.3f}" if elastic else "-"
        idle = " ".join(f"{x:.2f}" for x in m["idle_fraction"])
        pools = f" (train pool {m['async_train_cells']})" if m["async_train_cells"] else ""
        if m["masked_fraction"] or m["stale_dropped"]:
            pools += f" [spans masked {m['masked_fraction']:.0%}, executions dropped {m['stale_dropped']}]"
        lines.append(
            f"{mode:<9} {m['time_h']:>9.2f} {sp:>10} {m['ratio_to_ideal']:>7.2f} {m['ratio_to_bound']:>7.2f} {m['switches']:>9} "
            f"{m['timeouts']:>9}  {idle}{pools}"
        )
    return "\n".join(lines)


def format_compare(rows: list[dict]) -> str:
    """The seed's table side by side with the simulated speedups (async: even split; in brackets
    async with pools sized by the measured work share), elastic's ratio to the ideal and switches."""
    head = (f"{'workload (seed)':<44} {'seed vs Async':>27} {'sim vs Async':>12} {'(work share)':>12} "
            f"{'seed vs Colocate':>18} {'sim vs Colocate':>15} {'elastic/ideal':>13}  elastic h  switches")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['workload']:<44} {r['seed_vs_async']:>27} {r['sim_vs_async']:>12} {r['sim_vs_async_work_share']:>12} "
            f"{r['seed_vs_colocate']:>18} {r['sim_vs_colocate']:>15} {r['elastic_ideal']:>13}  "
            f"{r['sim_elastic_h']}  {r['elastic_switches']}"
        )
    return "\n".join(lines)


def format_sensitivity(table: dict) -> str:
    """Speedup as switch cost grows and as the duration tail thickens."""
    lines = ["switch cost (x seed's 8.52 s / 3.46 s)   elastic h   vs async   vs colocate"]
    for r in table["switch_cost"]:
        lines.append(f"{r['switch_cost_scale']:>38.1f}x {r['elastic_h']:>10} {_g(r, 'vs_async'):>10} {_g(r, 'vs_colocate'):>13}")
    lines.append("duration tail (x profile's sigma)        elastic h   vs async   vs colocate")
    for r in table["tail"]:
        lines.append(f"{r['tail_scale']:>38.1f}x {r['elastic_h']:>10} {_g(r, 'vs_async'):>10} {_g(r, 'vs_colocate'):>13}")
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
