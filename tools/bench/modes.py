"""Elastic vs async vs colocate, live: the same main job (toy harness, long-tailed tool times,
tiny model, local cells under CPU quotas) once per scheduler mode, one after another.

Each mode runs `gyre-train` with the same seed, steps, staleness bound and cells; only
`scheduler=` differs. The cells' CPU quotas make their compute a fixed budget like a GPU's, so
wall time is the figure compared (the speedup of elastic over each baseline); the CPU-seconds the
run's processes used (getrusage of the reaped children) are printed beside it. Then the simulator,
calibrated on the first mode's run alone (gyre.sim.calibrate), predicts every mode, and each
prediction is set against that mode's live time (first execution to last optimizer step: what
the simulator models).

    PYTHONPATH=. python tools/bench/modes.py [--steps 10] [--modes elastic,async,colocate] [-- OVERRIDES...]
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gyre.sim.calibrate import compose_sim, live_wall, load_run, make_overrides, predict

ROOT = Path(__file__).resolve().parents[2]


def run_mode(mode: str, steps: int, seed: int, out: Path, overrides: list[str]) -> dict:
    """One main job in `mode`; its summary plus the wall and CPU seconds it took."""
    cmd = [sys.executable, "-m", "gyre.launch.train", f"hydra.run.dir={out / mode}", f"scheduler={mode}",
           f"num_steps={steps}", f"seed={seed}", *overrides]  # fmt: skip
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall, after = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"{mode}: gyre-train exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return summary | {"bench_wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="elastic,async,colocate")
    p.add_argument("--out", default=None, help="run directories go here (default: a temporary directory)")
    p.add_argument("overrides", nargs="*", help="gyre-train overrides for every mode (after --)")
    a = p.parse_args()
    modes = a.modes.split(",")
    with tempfile.TemporaryDirectory(prefix="gyre-modes-") as tmp:
        out = Path(a.out or tmp)
        results = {m: run_mode(m, a.steps, a.seed, out, a.overrides) for m in modes}
        runs = {m: load_run(out / m) for m in modes}
        live = {m: live_wall(run)["live_s"] for m, run in runs.items()}
        predicted = predict(compose_sim(make_overrides(runs[modes[0]]), modes))
    print(f"{'mode':<10} {'wall_s':>7} {'cpu_s':>7} {'steps':>5} {'reward first3':>13} {'last3':>6} {'switches':>8}")
    for m, r in results.items():
        print(f"{m:<10} {r['wall_s']:>7} {r['cpu_s']:>7} {r['num_steps']:>5} {r.get('reward_first3', 0):>13.3f} "
              f"{r.get('reward_last3', 0):>6.3f} {r.get('num_role_switches', 0):>8}")  # fmt: skip
    report = {m: {k: r.get(k) for k in ("wall_s", "cpu_s", "num_steps", "reward_first3", "reward_last3",
                                        "num_role_switches", "executions")} for m, r in results.items()}  # fmt: skip
    print(f"simulator calibrated on the {modes[0]} run:")
    for m in modes:
        report[m] |= {"live_s": live[m], "predicted_s": round(predicted[m], 1), "predicted_ratio": round(predicted[m] / live[m], 3)}
        print(f"  {m:<10} live {live[m]:7.1f} s  predicted {predicted[m]:7.1f} s  ({predicted[m] / live[m]:.3f}x)")
    if "elastic" in results:
        for m in modes:
            if m != "elastic":
                report[f"speedup_vs_{m}"] = round(results[m]["wall_s"] / results["elastic"]["wall_s"], 3)
                print(f"elastic vs {m}: {report[f'speedup_vs_{m}']}x faster (wall)")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
