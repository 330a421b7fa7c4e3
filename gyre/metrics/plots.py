"""The run's pictures (matplotlib, Agg): timeline.png, reward.png, tokens.png, utilisation.png, compare.png.

`draw_timelines` is the one timeline drawing, used by live runs (from a RunState, with each
switch's phases) and by the simulator (gyre.sim.report builds its panels from simulated cells).
"""

import os
from pathlib import Path
from statistics import fmean

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib import colormaps, patheffects
from matplotlib.patches import Patch
from matplotlib.ticker import PercentFormatter

from gyre.common.files import atomic_path
from gyre.common.run_paths import RunPaths
from gyre.metrics.state import RunState, Span, TimelinePanel, mean_se
from gyre.scheduler.cells import PHASES

ROLE_COLOURS = {
    "rollout": "tab:blue",
    "train": "tab:orange",
    "to_train": "tab:red",
    "to_rollout": "tab:purple",
    "lost": "black",
}
_PHASE_ORDER = {role.value: tuple(p.value for p in phases) for role, phases in PHASES.items()}
_PHASE_MAPS = {"to_train": "Reds", "to_rollout": "Purples"}
DPI = 100
TIMELINE_WIDTH_IN = 12
MIN_MARK_PX = 3
"""The narrowest a role switch is drawn on a timeline, in pixels."""


def save(fig, path: str | os.PathLike) -> None:
    """Write the figure beside `path`, then rename it there: a viewer never opens half a PNG."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=DPI, format="png")
    plt.close(fig)


def span_colour(span: Span) -> str | tuple:
    """A role's colour; a switch phase gets a shade of its switching state's colour map."""
    order = _PHASE_ORDER.get(span.role, ())
    if span.phase is None or span.phase not in order:
        return ROLE_COLOURS.get(span.role, "grey")
    return colormaps[_PHASE_MAPS[span.role]](0.35 + 0.55 * order.index(span.phase) / max(len(order) - 1, 1))


def time_unit(seconds: float) -> tuple[str, float]:
    """(label, divisor) that keeps a span of `seconds` readable."""
    if seconds <= 600:
        return "seconds", 1.0
    return ("minutes", 60.0) if seconds <= 2 * 3600 else ("hours", 3600.0)


def draw_timelines(panels: list[TimelinePanel], path: str | os.PathLike) -> None:
    """One panel per run: each cell's role over time (switch phases shaded), the waterlevel on a second axis.

    Panels share one time scale (the longest run's) and one waterlevel scale, so a shorter run ends
    early. A switch too short to see at that scale (sub-second switches on a minutes-long axis) is
    drawn as a mark MIN_MARK_PX wide in its switching state's colour, over its neighbours, so every
    switch shows; the legend names only what is drawn.
    """
    longest_s = max(p.t1 - p.t0 for p in panels)
    unit, div = time_unit(longest_s)
    min_w = MIN_MARK_PX / (TIMELINE_WIDTH_IN * DPI * 0.85) * longest_s / div
    top_level = max((w for p in panels for _, w in p.levels), default=0)
    ratios = [0.9 + 0.32 * len(p.lanes) for p in panels]
    height = sum(ratios) + 0.8
    fig, axes = plt.subplots(len(panels), 1, figsize=(TIMELINE_WIDTH_IN, height), squeeze=False, height_ratios=ratios)
    legend: dict[str, object] = {}
    for ax, p in zip(axes[:, 0], panels):
        for row, (_label, spans) in enumerate(p.lanes):
            for s in spans:
                x, w, z = (s.t0 - p.t0) / div, (s.t1 - s.t0) / div, 2
                if s.role in _PHASE_ORDER and w < min_w:
                    s, w, z = Span(s.t0, s.t1, s.role), min_w, 3
                colour = span_colour(s)
                ax.broken_barh([(x, w)], (row - 0.4, 0.8), color=colour, lw=0, zorder=z)
                legend.setdefault(s.phase or s.role, colour)
        ax.set_yticks(range(len(p.lanes)), [label for label, _ in p.lanes])
        ax.set_ylim(-0.6, len(p.lanes) - 0.4)
        ax.invert_yaxis()
        ax.set_xlim(0, longest_s / div)  # one scale for every panel, so runs compare at a glance
        ax.set_title(p.title, loc="left", fontsize=10)
        if p.levels:
            twin = ax.twinx()
            xs = [(t - p.t0) / div for t, _ in p.levels] + [(p.t1 - p.t0) / div]
            ys = [w for _, w in p.levels] + [p.levels[-1][1]]
            twin.step(
                xs,
                ys,
                where="post",
                color="black",
                lw=1.1,
                label="waterlevel",
                path_effects=[patheffects.withStroke(linewidth=2.8, foreground="white")],
            )  # readable on any bar
            twin.set_ylim(0, top_level * 1.15 + 1)
            twin.set_ylabel("waterlevel", fontsize=9)
    axes[-1, 0].set_xlabel(unit)
    handles = [Patch(color=c, label=k.replace("_", " ")) for k, c in _legend_order(legend)]
    handles.append(plt.Line2D([], [], color="black", lw=1.0, label="waterlevel"))
    ncol = min(len(handles), 7)
    fig.legend(handles=handles, loc="upper center", ncol=ncol, fontsize=8, frameon=False)
    rows = -(-len(handles) // ncol)
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.1 + 0.2 * rows) / height))
    save(fig, path)


def _legend_order(legend: dict) -> list:
    order = [
        "rollout",
        "train",
        "to_train",
        *_PHASE_ORDER["to_train"],
        "to_rollout",
        *_PHASE_ORDER["to_rollout"],
        "lost",
    ]
    return sorted(legend.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))


def lane_label(state: RunState, index: int) -> str:
    core = state.run.core_cell if state.run else None
    return f"core (cell {index})" if index == core else f"cell {index}"


def timeline_panel(state: RunState, title: str) -> TimelinePanel:
    lanes = [(lane_label(state, i), state.cells[i].spans_until(state.t_last)) for i in sorted(state.cells)]
    return TimelinePanel(title, lanes, state.levels, state.t_first, state.t_last)


SMOOTH_STEPS = 3
"""Steps in the trained reward's moving mean: the summary's reward_first3 / reward_last3 window."""


def moving_mean(values: list[float], window: int) -> list[float]:
    """Each value's mean with up to `window - 1` values before it."""
    return [fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def plot_reward(state: RunState, path: str | os.PathLike, title: str) -> None:
    """Each evaluated execution's reward per step (dots), the step's mean and its +-1 std band; the
    trained batch's mean and its moving mean; the held-out tasks' mean reward at each weight version
    they were rolled out under, with its standard error: the rise with its spread."""
    by_step = state.step_rewards()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if by_step:
        steps = list(by_step)
        means = [sum(r) / len(r) for r in by_step.values()]
        stds = [(sum((x - m) ** 2 for x in r) / len(r)) ** 0.5 for r, m in zip(by_step.values(), means)]
        for k, rewards in by_step.items():  # spread sideways: many executions share a reward (0, 1)
            jitter = [k + 0.3 * ((i * 7919) % 11 / 10 - 0.5) for i in range(len(rewards))]
            ax.scatter(
                jitter,
                rewards,
                s=14,
                color="tab:blue",
                alpha=0.45,
                lw=0,
                label="one evaluated execution" if k == steps[0] else None,
            )
        ax.fill_between(
            steps,
            [m - s for m, s in zip(means, stds)],
            [m + s for m, s in zip(means, stds)],
            color="tab:blue",
            alpha=0.15,
            label="mean +- 1 std",
        )
        ax.plot(steps, means, color="tab:blue", marker="o", label="mean reward (evaluated executions)")
        trained = sorted(state.steps.items())
        if trained:
            ks, means_trained = [k for k, _ in trained], [s.reward_mean for _, s in trained]
            ax.plot(ks, means_trained, color="tab:orange", ls=":", marker="x", label="mean reward of the trained batch")
            ax.plot(
                ks,
                moving_mean(means_trained, SMOOTH_STEPS),
                color="tab:orange",
                lw=2,
                label=f"... its mean over the last {SMOOTH_STEPS} steps",
            )
        held_out = {v: r for v, r in sorted(state.held_out.items()) if r}
        if held_out:
            stats = [mean_se(r) for r in held_out.values()]
            ax.errorbar(
                list(held_out),
                [m for m, _ in stats],
                yerr=[se or 0.0 for _, se in stats],
                color="tab:green",
                marker="s",
                capsize=4,
                label="held-out tasks (never trained) by weight version, +- 1 standard error",
            )
        ax.set_xticks(sorted(set(steps) | set(state.held_out)))
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    else:
        ax.text(0.5, 0.5, "no evaluated executions yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step", labelpad=1)
    ax.set_ylabel("reward")
    if by_step and all(0.0 <= r <= 1.0 for rewards in by_step.values() for r in rewards):
        ax.set_ylim(-0.04, 1.04)
    ax.set_title(title, loc="left", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save(fig, path)


def plot_tokens(state: RunState, path: str | os.PathLike, title: str) -> None:
    """Training targets per step: naive (every path), capped (at most K paths), deduplicated (shared targets once)."""
    steps = sorted(state.steps.items())
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.27
    for j, (name, colour) in enumerate((("naive", "tab:grey"), ("capped", "tab:blue"), ("dedup", "tab:green"))):
        values = [getattr(s, f"targets_{name}") for _, s in steps]
        ax.bar([k + (j - 1) * width for k, _ in steps], values, width, color=colour, label=f"targets {name}")
    for k, s in steps:  # what cap and dedup saved, over the dedup bar
        if s.targets_naive:
            saved = 1 - s.targets_dedup / s.targets_naive
            ax.annotate(
                f"-{saved:.0%}" if saved >= 0.005 else "0%",
                (k + width, s.targets_dedup),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks([k for k, _ in steps])
    ax.set_xlabel("step", labelpad=1)
    ax.set_ylabel("target tokens")
    ax.set_ylim(0, max((s.targets_naive for _, s in steps), default=0) * 1.08 or 1)
    ax.set_title(title, loc="left", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    handles.append(Patch(color="none", label="-x%: dedup vs naive"))
    ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save(fig, path)


_UTIL_PARTS = (
    ("rollout", "busy", "tab:blue", 1.0),
    ("rollout", "idle", "tab:blue", 0.3),
    ("train", "busy", "tab:orange", 1.0),
    ("train", "idle", "tab:orange", 0.3),
    ("switching", "", "tab:red", 0.8),
    ("lost", "", "black", 1.0),
)


def utilisation(state: RunState) -> dict[int, dict[str, float]]:
    """Per cell, the share of the run's time in each part: rollout/train busy and idle, switching, lost."""
    total = max(state.duration_s, 1e-9)
    out = {}
    for i in sorted(state.cells):
        time_s = state.role_time_s(i)
        busy = {r: state.busy_s(i, r) for r in ("rollout", "train")}
        out[i] = {
            "rollout busy": busy["rollout"] / total,
            "rollout idle": (time_s.get("rollout", 0.0) - busy["rollout"]) / total,
            "train busy": busy["train"] / total,
            "train idle": (time_s.get("train", 0.0) - busy["train"]) / total,
            "switching": (time_s.get("to_train", 0.0) + time_s.get("to_rollout", 0.0)) / total,
            "lost": time_s.get("lost", 0.0) / total,
        }
    return out


def plot_utilisation(state: RunState, path: str | os.PathLike, title: str) -> None:
    """One bar per cell: share of run time per role, busy (serving a call / computing a micro-step) vs idle."""
    shares = utilisation(state)
    cells = list(shares)
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.55 * max(len(cells), 1)))
    left = [0.0] * len(cells)
    for role, part, colour, alpha in _UTIL_PARTS:
        key = f"{role} {part}".strip()
        widths = [shares[i][key] for i in cells]
        if not any(w > 0 for w in widths):
            continue
        ax.barh(range(len(cells)), widths, left=left, color=colour, alpha=alpha, label=key, edgecolor="white", lw=0.5)
        for row, (x, w) in enumerate(zip(left, widths)):
            if w >= 0.06 and part != "idle":
                ax.text(
                    x + w / 2,
                    row,
                    f"{w:.0%}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white" if alpha >= 0.8 else "black",
                )
        left = [x + w for x, w in zip(left, widths)]
    ax.set_yticks(range(len(cells)), [lane_label(state, i) for i in cells])
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("share of run time")
    ax.set_title(title, loc="left", fontsize=10)
    fig.legend(fontsize=8, ncol=6, loc="lower center", frameon=False)
    fig.tight_layout(rect=(0, 0.22 / fig.get_figheight(), 1, 1))
    save(fig, path)


def write_figures(state: RunState, out_dir: str | os.PathLike, name: str) -> list[Path]:
    """Every figure of one run into `out_dir`; returns their paths."""
    paths = {k: RunPaths(out_dir).figure(k) for k in ("timeline", "reward", "tokens", "utilisation")}
    if state.t_first is None:
        return []
    draw_timelines([timeline_panel(state, f"{name}: cell roles and waterlevel")], paths["timeline"])
    plot_reward(state, paths["reward"], f"{name}: reward per step")
    plot_tokens(state, paths["tokens"], f"{name}: training targets per step (path cap, then prefix dedup)")
    plot_utilisation(state, paths["utilisation"], f"{name}: per-cell time by role, busy vs idle")
    return list(paths.values())


def plot_compare(states: list[RunState], names: list[str], path: str | os.PathLike) -> None:
    """Runs side by side: mean reward per step against wall time, and steps done against wall time."""
    span = max((s.duration_s for s in states), default=0.0)
    unit, div = time_unit(span)
    fig, (ax_r, ax_s) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s, name in zip(states, names):
        steps = sorted(s.steps.values(), key=lambda e: e.step)
        xs = [(e.t - s.t_first) / div for e in steps]
        ax_r.plot(xs, [e.reward_mean for e in steps], marker="o", label=name)
        ax_s.step([0.0, *xs], range(len(xs) + 1), where="post", label=name)
    for ax, ylabel in ((ax_r, "mean reward of the trained batch"), (ax_s, "optimizer steps done")):
        ax.set_xlabel(unit)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path)
