"""Simulator speed at the issue's scale: 48 steps x 192 nodes x 1,024 executions per step, per mode.

Target: <= 30 s of CPU time per mode (the process's own, from /proc via time.process_time: the
shared 2-core box's wall time depends on its other tenants). Prints one line per mode, then one
JSON object on the last line. Run: PYTHONPATH=. python tools/bench/sim.py [--steps 48]
[--smoke] (the test suite's run: every mode for 1 step of 2 groups of 4).
"""

import argparse
import os
import time

import hydra

from gyre.common import CONF_DIR, jsonio
from gyre.config import validate
from gyre.sim.config import SimConfig

TARGET_S = 30.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--smoke", action="store_true", help="smallest sizes, seconds (the test suite's run)")
    args = parser.parse_args()
    groups, group_size = (2, 4) if args.smoke else (64, 16)
    overrides = [
        "profile=nl2repo",
        "preset=qwen2t4_192n",
        f"num_steps={1 if args.smoke else args.steps}",
        f"profile.groups_per_step={groups}",
        f"profile.group_size={group_size}",
    ]
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        sim = validate(hydra.compose(config_name="sim", overrides=overrides), SimConfig)
    from gyre.sim.runner import run_modes

    out = {
        "steps": sim.num_steps,
        "nodes": sim.preset.num_nodes,
        "executions_per_step": sim.profile.executions_per_step,
        "target_s": TARGET_S,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "modes": {},
    }
    for mode in sim.modes:
        t0, c0 = time.perf_counter(), time.process_time()
        (r,) = run_modes(sim, modes=[mode])
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        out["modes"][mode] = {
            "cpu_s": round(cpu, 2),
            "wall_s": round(wall, 2),
            "simulated_h": round(r.total_s / 3600, 2),
        }
        print(
            f"{mode:<9} {cpu:6.2f} s CPU ({wall:6.2f} s wall) for {r.total_s / 3600:7.2f} simulated h "
            f"({sim.num_steps} steps x {sim.preset.num_nodes} nodes x {sim.profile.executions_per_step} "
            "executions/step)"
        )
    out["max_cpu_s"] = max(m["cpu_s"] for m in out["modes"].values())
    out["meets_target"] = out["max_cpu_s"] <= TARGET_S
    print(jsonio.dumps(out))


if __name__ == "__main__":
    main()
