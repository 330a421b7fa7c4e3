"""`gyre-sim`: the Hydra app that runs the simulator (conf/sim.yaml) and prints or plots the results.

I/O lives here only: composing configs, printing tables, writing the PNG. Everything it prints
comes from gyre.sim.runner on validated configs.
"""

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from gyre.common import CONF_DIR, jsonio
from gyre.config import validate
from gyre.errors import ConfigError
from gyre.metrics.plots import draw_timelines
from gyre.sim.config import SimConfig
from gyre.sim.report import format_compare, format_labels, format_modes, format_sensitivity, timeline_panels
from gyre.sim.runner import baselines, label_table, mechanisms, run_modes, sensitivity, summarize
from gyre.sim.seed import SEED_ROWS

_SCENARIO_KEYS = (
    "profile=",
    "preset=",
    "num_steps=",
    "compare=",
    "sensitivity=",
    "json=",
    "plot=",
    "modes=",
    "baselines=",
    "mechanisms=",
)


def _compare_rows(user_overrides: list[str]) -> list[dict]:
    """Run each seed scenario (every mode) and pair the simulated speedups with the seed's.

    The user's other overrides (e.g. `scheduler.critical_path=false`, `seed=3`) apply to every
    scenario; the scenario sets the profile, preset and number of steps.
    """
    kept = [o for o in user_overrides if not o.lstrip("+~").startswith(_SCENARIO_KEYS)]
    rows = []
    for row in SEED_ROWS:
        sims = []
        for preset in row.presets:
            cfg = hydra.compose(
                config_name="sim",
                overrides=[
                    *kept,
                    f"profile={row.profile}",
                    f"preset={preset}",
                    f"num_steps={row.num_steps}",
                    *row.overrides,
                ],
            )
            sim = validate(cfg, SimConfig)
            runs = baselines(sim)
            table = label_table(runs)
            print(f"\n{row.workload} on {preset}:\n{format_labels(table)}", flush=True)
            sims.append(dict(_speedups(runs), table=table))
        rows.append(
            {
                "workload": row.workload,
                "seed_vs_async": row.vs_async,
                "seed_vs_colocate": row.vs_colocate,
                **{k: _span([s[k] for s in sims]) for k in sims[0] if k not in ("table", "t_over_r", "sim_elastic_h")},
                "t_over_r": " / ".join(f"{s['t_over_r']:.2f}" for s in sims),
                "sim_elastic_h": " / ".join(f"{s['sim_elastic_h']:.1f}" for s in sims),
                "runs": [s["table"] for s in sims],
            }
        )
    return rows


def _speedups(runs: list) -> dict:
    """Elastic's speedup over each baseline variant, its ratio to the bound, T/R, hours."""
    by = {label: r.total_s for label, r in runs}
    elastic = by["elastic"]
    table = label_table(runs)
    oracle = next(label for label in by if label.startswith("async oracle"))
    colocate = [label for label in by if label.startswith("colocate")]
    return {
        "vs_async_even": by["async even"] / elastic,
        "vs_async_oracle": by[oracle] / elastic,
        "vs_async_per_role": by["async even, tier per role"] / elastic,
        "vs_colocate": by[colocate[0]] / elastic,
        "vs_colocate_s0": by[colocate[-1]] / elastic,
        "elastic_bound": table["rows"][0]["ratio_to_bound"],
        "t_over_r": table["regime"]["t_over_r"],
        "sim_elastic_h": elastic / 3600,
    }


def _span(values: list[float]) -> str:
    lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="sim")
def run(cfg: DictConfig) -> None:
    try:
        sim = validate(cfg, SimConfig)
    except ConfigError as e:
        sys.exit(f"gyre-sim: invalid config: {e}")
    results = run_modes(sim)
    out = summarize(sim, results)
    print(format_modes(out))
    if sim.plot:
        path = os.path.join(HydraConfig.get().runtime.output_dir, sim.plot)
        draw_timelines(timeline_panels(results), path)
        out["plot"] = path
        print(f"timeline: {path}")
    if sim.baselines:
        out["baselines"] = label_table(baselines(sim))
        print(
            f"\nelastic and every baseline variant on {sim.profile.name} / {sim.preset.name}:\n"
            f"{format_labels(out['baselines'])}"
        )
    if sim.mechanisms:
        out["mechanisms"] = label_table(mechanisms(sim))
        print(
            f"\neach policy mechanism alone on {sim.profile.name} / {sim.preset.name}:\n"
            f"{format_labels(out['mechanisms'])}"
        )
    if sim.sensitivity:
        out["sensitivity"] = sensitivity(sim)
        print(f"\nsensitivity on {sim.profile.name} / {sim.preset.name}:\n{format_sensitivity(out['sensitivity'])}")
    if sim.compare:
        out["compare"] = _compare_rows(list(HydraConfig.get().overrides.task))
        print(f"\nthe seed's figures beside the simulator's:\n{format_compare(out['compare'])}")
    if sim.json:
        print(jsonio.dumps(out))


def main() -> None:
    run()


if __name__ == "__main__":
    main()
