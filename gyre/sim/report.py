"""Rendering of simulator results: text tables (pure) and the PNG timeline (writes one file)."""

from gyre.sim.result import ModeResult

ROLE_COLOURS = {"rollout": "tab:blue", "train": "tab:orange", "to_train": "tab:red",
                "to_rollout": "tab:purple", "lost": "black"}


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


def plot_timeline(results: list[ModeResult], path: str) -> None:
    """One panel per mode: each cell's role over time, and the waterlevel curve on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(results), 1, figsize=(12, 2.2 + 1.6 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        for c in r.cells:
            spans = c.timeline + [(r.total_s, "")]
            for (t0, role), (t1, _) in zip(spans, spans[1:]):
                if t1 > t0:
                    ax.broken_barh([(t0 / 3600, (t1 - t0) / 3600)], (c.index - 0.4, 0.8), color=ROLE_COLOURS[role])
        ax.set_yticks([c.index for c in r.cells], [("core" if c.is_core else f"cell {c.index}") for c in r.cells])
        ax.set_title(f"{r.mode}: {r.total_s / 3600:.1f} h")
        ax.set_xlim(0, r.total_s / 3600)
        twin = ax.twinx()
        twin.plot([t / 3600 for t, _ in r.levels], [w for _, w in r.levels], color="black", lw=0.7)
        twin.set_ylabel("waterlevel")
    axes[-1, 0].set_xlabel("hours")
    fig.legend(handles=[Patch(color=v, label=k) for k, v in ROLE_COLOURS.items()], loc="upper right", ncol=5)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=90)
    plt.close(fig)
