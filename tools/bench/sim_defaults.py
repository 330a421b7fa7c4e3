"""Benchmark: elastic with the default scheduler config on every profile x preset of `gyre-sim`.

Each cell of the matrix runs elastic on the seed's scenario for that profile (its number of steps,
gyre.sim.seed) and prints its ratio to its own bound (the tighter bound on its own work; issue 28
target: <= 1.10 in every cell). Extra arguments are Hydra overrides applied to every cell, e.g.
`scheduler.microstep_tokens=0` to see a default's share.

Run: PYTHONPATH=. python tools/bench/sim_defaults.py [--smoke] [OVERRIDE ...]
(--smoke, the test suite's run: every cell for 1 step of 2 groups of 2).
Last line: one JSON object {"cells": [...], "max_ratio_to_own_bound", "meets_target", ...}.
"""

import os
import sys
import time

import hydra

from gyre.common import CONF_DIR, jsonio
from gyre.config import validate
from gyre.sim.config import SimConfig
from gyre.sim.runner import run_modes
from gyre.sim.seed import SEED_ROWS

TARGET = 1.10
PROFILES = ("nl2repo", "deepswe", "terminalbench")
PRESETS = ("qwen122b_24n", "qwen122b_32n", "qwen2t4_192n")
SMOKE = ["num_steps=1", "profile.groups_per_step=2", "profile.group_size=2"]


def main() -> None:
    overrides = sys.argv[1:]
    if "--smoke" in overrides:
        overrides.remove("--smoke")
        overrides += SMOKE
    steps = {row.profile: row.num_steps for row in SEED_ROWS}
    cells, c0 = [], time.process_time()
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for profile in PROFILES:
            for preset in PRESETS:
                cfg = hydra.compose(
                    config_name="sim",
                    overrides=[f"profile={profile}", f"preset={preset}", f"num_steps={steps[profile]}", *overrides],
                )
                sim = validate(cfg, SimConfig)
                (r,) = run_modes(sim, modes=["elastic"])
                ratio = r.total_s / r.own_bound_s
                cells.append(
                    {
                        "profile": profile,
                        "preset": preset,
                        "steps": sim.num_steps,
                        "elastic_h": round(r.total_s / 3600, 3),
                        "ratio_to_own_bound": round(ratio, 3),
                        "masked_fraction": round(r.masked_fraction, 3),
                        "stale_dropped": r.num_stale_dropped,
                    }
                )
                print(
                    f"{profile:<14} {preset:<13} {sim.num_steps:>3} steps: elastic {r.total_s / 3600:7.2f} h, "
                    f"{ratio:.3f}x its own bound (masked {r.masked_fraction:.3f})",
                    flush=True,
                )
    worst = max(c["ratio_to_own_bound"] for c in cells)
    print(
        jsonio.dumps(
            {
                "overrides": overrides,
                "cells": cells,
                "max_ratio_to_own_bound": worst,
                "target": TARGET,
                "meets_target": worst <= TARGET,
                "cpu_s": round(time.process_time() - c0, 1),
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
