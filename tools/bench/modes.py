"""Elastic vs async vs colocate, live: the same main job (toy harness, long-tailed tool times,
tiny model, local cells under CPU quotas) once per scheduler mode, one after another.

Each mode runs `gyre-train` with the same seed, steps, staleness bound and cells; only the
scheduler differs. `async` is the even split a user picks before knowing the workload;
`async-tuned` is the pool size the simulator's sweep finds best for the workload of the first
run (the oracle). The cells' CPU quotas make their compute a fixed budget like a GPU's, so wall
time is the figure compared: elastic's speedup over each baseline is taken from the first
execution to the last optimizer step (the first run also trains the warm start the others
reuse); the CPU-seconds the run's processes used (getrusage of the reaped children) are printed
beside it. Then the simulator, calibrated on the first run alone (gyre.sim.calibrate), predicts
every mode and gives the lower bound max(work / capacity, critical path, startup) of this
workload; each prediction is set against that mode's live time (first execution to last
optimizer step: what the simulator models). Calibrated on each mode's own run, it predicts that
mode again: runs of one seed differ in the work they train (a group whose rewards come out
uniform is not trained), so the live speedups are printed beside the simulated ones at equal work
(every mode on the first run's workload).

    PYTHONPATH=. python tools/bench/modes.py [--steps 10] [--modes elastic,async,async-tuned,colocate]
        [--experiment NAME] [--out DIR] [-- OVERRIDES...]
    PYTHONPATH=. python tools/bench/modes.py --from DIR [--modes ...]

--experiment NAME runs every mode on conf/experiment/NAME.yaml (`+experiment=NAME`), at its own
num_steps unless --steps is given: `--experiment burst` is the capacity-bound workload where the
schedule, not the latency of the executions, decides the time. Beside each mode's live time the
report gives the simulator's prediction over it (`sim_over_live`), the lower bound's three terms
and which binds (`bound_terms_s`, `bound_binds`), and for each baseline the most a schedule at the
bound could gain over its live run (`ceiling_vs_<mode>`: live / bound).

--from DIR predicts again from the run directories an earlier run left under `--out DIR` (one per
mode, no live run): the simulator calibrated on the first mode's run, each mode's prediction over
its live time, async-tuned with the training pool its run was given; one JSON object last.

--smoke (the test suite's run) is the simulator side alone, uncalibrated (every live run takes
minutes): each mode predicted, async-tuned's pool from the oracle sweep, and the lower bound, on
the default simulator config shrunk to 2 steps of 2 groups of 2; one JSON object.
"""

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from gyre.common import jsonio
from gyre.sim.calibrate import compose_sim, live_wall, load_run, make_overrides
from gyre.sim.result import ideal_lower_bound_s
from gyre.sim.runner import baselines, run_modes

ROOT = Path(__file__).resolve().parents[2]
MODES = ("elastic", "async", "async-tuned", "colocate")
SMOKE_SIM = ["num_steps=2", "profile.groups_per_step=2", "profile.group_size=2"]
EXPERIMENTS = ROOT / "conf" / "experiment"
DEFAULT_STEPS = 10


def run_mode(mode: str, scheduler: list[str], steps: int | None, seed: int, out: Path, overrides: list[str]) -> dict:
    """One main job; its summary plus the wall and CPU seconds it took (steps None: the config's)."""
    cmd = [
        sys.executable,
        "-m",
        "gyre.launch.train",
        f"hydra.run.dir={out / mode}",
        *scheduler,
        *([f"num_steps={steps}"] if steps is not None else []),
        f"seed={seed}",
        *overrides,
    ]
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall, after = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"{mode}: gyre-train exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = jsonio.loads(proc.stdout.strip().splitlines()[-1])
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return summary | {"bench_wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}


def oracle_train_cells(sim) -> int:
    """The async training-pool size (core included) the calibrated simulator's sweep finds fastest."""
    return next(r for label, r in baselines(sim) if label.startswith("async oracle")).async_train_cells


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help=f"default: the experiment's, else {DEFAULT_STEPS}")
    p.add_argument("--experiment", default=None, help="a conf/experiment preset for every mode (e.g. burst)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated, the first calibrates ({', '.join(MODES)})"
    )
    p.add_argument("--out", default=None, help="run directories go here (default: a temporary directory)")
    p.add_argument("overrides", nargs="*", help="gyre-train overrides for every mode (after --)")
    p.add_argument("--from", dest="from_dir", default=None, help="predict again from an earlier --out DIR's runs")
    p.add_argument("--smoke", action="store_true", help="the simulator side alone, seconds (the test suite's run)")
    a = p.parse_args()
    a.modes = a.modes.split(",")
    unknown = [m for m in a.modes if m not in MODES]
    if unknown or a.modes[0] == "async-tuned":
        sys.exit(f"modes: {a.modes!r}; valid: {', '.join(MODES)}, the first calibrates the simulator (not async-tuned)")
    a.overrides = make_train_overrides(a.experiment, a.overrides)
    if a.steps is None and a.experiment is None:
        a.steps = DEFAULT_STEPS
    return a


def make_train_overrides(experiment: str | None, overrides: list[str]) -> list[str]:
    """gyre-train overrides for every mode: the experiment preset first, so the user's win."""
    if experiment is None:
        return overrides
    valid = sorted(f.stem for f in EXPERIMENTS.glob("*.yaml"))
    if experiment not in valid:
        sys.exit(f"--experiment: unknown {experiment!r}; valid: {', '.join(valid)}")
    return [f"+experiment={experiment}", *overrides]


def run_all(a: argparse.Namespace) -> tuple[dict, dict, dict, object, int | None]:
    """Every mode's run: (summaries, live seconds, each's own simulated seconds, the simulator
    calibrated on the first run, async-tuned's training pool)."""
    modes = a.modes
    with tempfile.TemporaryDirectory(prefix="gyre-modes-") as tmp:
        out = Path(a.out or tmp)
        results, live, own, sim, tuned = {}, {}, {}, None, None
        for m in modes:
            scheduler = [f"scheduler={m}"]
            if m == "async-tuned":
                tuned = oracle_train_cells(sim)
                scheduler = ["scheduler=async", f"scheduler.async_train_cells={tuned}"]
            results[m] = run_mode(m, scheduler, a.steps, a.seed, out, a.overrides) | {"scheduler": scheduler}
            run = load_run(out / m)
            live[m] = live_wall(run)["live_s"]
            overrides = make_overrides(run)
            if sim is None:  # the first run calibrates every prediction; its own is among them
                sim = compose_sim(overrides, [x for x in modes if x != "async-tuned"])
            else:
                (own_run,) = run_modes(compose_sim(overrides, [run.config["scheduler"]["mode"]]))
                own[m] = own_run.total_s
    return results, live, own, sim, tuned


def print_runs(results: dict) -> None:
    print(
        f"{'mode':<12} {'wall_s':>7} {'cpu_s':>7} {'steps':>5} {'trained':>7} {'reward first3':>13} "
        f"{'last3':>6} {'switches':>8}  "
        "per cell: busy/held rollout, busy/held train"
    )
    for m, r in results.items():
        busy = "  ".join(
            f"{i}: {u['rollout busy']:.2f}/{u['rollout busy'] + u['rollout idle']:.2f} "
            f"{u['train busy']:.2f}/{u['train busy'] + u['train idle']:.2f}"
            for i, u in r["cell_utilisation"].items()
        )
        print(
            f"{m:<12} {r['wall_s']:>7} {r['cpu_s']:>7} {r['num_steps']:>5} {r['executions'].get('trained', 0):>7} "
            f"{r.get('reward_first3') or 0:>13.3f} "
            f"{r.get('reward_last3') or 0:>6.3f} {r.get('num_role_switches', 0):>8}  {busy}"
        )


REPORT_KEYS = (
    "scheduler",
    "wall_s",
    "cpu_s",
    "num_steps",
    "reward_first3",
    "reward_last3",
    "reward_per_step",
    "executions",
    "num_role_switches",
    "switch_phase_s",
    "cell_role_share",
    "cell_utilisation",
)


def bound_terms_s(results) -> dict[str, float]:
    """The lower bound's terms over simulated runs (gyre.sim.result.tighter_bound_s is their max):
    work / capacity, the critical path, and work / capacity after the first group can be ready."""
    return {
        "work": ideal_lower_bound_s(results),
        "critical_path": min(r.critical_path_s for r in results),
        "startup": min(r.startup_bound_s for r in results),
    }


def predict_modes(sim, modes: list[str], tuned: int | None) -> tuple[dict, dict]:
    """Each mode's simulated seconds (async-tuned: async with `tuned` training cells) and the
    terms of the workload's tighter lower bound."""
    simulated = run_modes(sim)
    terms = bound_terms_s(simulated)
    simulated = {r.mode: r.total_s for r in simulated}
    predicted = {m: simulated[m] for m in modes if m != "async-tuned"}
    if tuned is not None:
        (r,) = run_modes(replace(sim, scheduler=replace(sim.scheduler, async_train_cells=tuned)), modes=["async"])
        predicted["async-tuned"] = r.total_s
    return predicted, terms


def smoke(modes: list[str]) -> None:
    """The simulator side of the bench without live runs (see the module docstring)."""
    sim = compose_sim(SMOKE_SIM, [m for m in modes if m != "async-tuned"])
    tuned = oracle_train_cells(sim) if "async-tuned" in modes else None
    predicted, terms = predict_modes(sim, modes, tuned)
    bound_s = max(terms.values())
    for m, seconds in predicted.items():
        print(f"  {m:<12} predicted {seconds:7.1f} s  / bound {seconds / bound_s:.3f}")
    report = {"predicted_s": {m: round(x, 1) for m, x in predicted.items()}} | bound_report(terms)
    print(jsonio.dumps(report | {"async_tuned_train_cells": tuned}))


def repredict(out: Path, modes: list[str]) -> None:
    """The simulator side again from the run directories under `out` (see the module docstring)."""
    runs = {m: load_run(out / m) for m in modes}
    sim = compose_sim(make_overrides(runs[modes[0]]), [m for m in modes if m != "async-tuned"])
    tuned = runs["async-tuned"].config["scheduler"]["async_train_cells"] if "async-tuned" in runs else None
    predicted, terms = predict_modes(sim, modes, tuned)
    report = {}
    for m in modes:
        live = live_wall(runs[m])["live_s"]
        report[m] = {
            "live_s": live,
            "predicted_s": round(predicted[m], 1),
            "sim_over_live": round(predicted[m] / live, 3),
        }
        print(f"  {m:<12} live {live:7.1f} s  predicted {predicted[m]:7.1f} s ({predicted[m] / live:.3f}x)")
    print(jsonio.dumps(report | bound_report(terms) | {"calibrated_on": modes[0]}))


def bound_report(terms: dict[str, float]) -> dict:
    """The bound, its terms and the one that binds, JSON-ready."""
    return {
        "bound_s": round(max(terms.values()), 1),
        "bound_terms_s": {k: round(v, 1) for k, v in terms.items()},
        "bound_binds": max(terms, key=terms.get),
    }


def main() -> None:
    a = parse_args()
    modes = a.modes
    if a.smoke:
        return smoke(modes)
    if a.from_dir:
        return repredict(Path(a.from_dir), modes)
    results, live, own, sim, tuned = run_all(a)
    predicted, terms = predict_modes(sim, modes, tuned)
    bound_s = max(terms.values())
    own[modes[0]] = predicted[modes[0]]

    print_runs(results)
    report = {m: {k: r.get(k) for k in REPORT_KEYS} for m, r in results.items()}
    print(
        f"simulator calibrated on the {modes[0]} run (its lower bound max(work/capacity, critical path, startup): "
        f"{bound_s:.1f} s, {max(terms, key=terms.get)} binds: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in terms.items())
        + "), and on each mode's own run (the work it trained, its cells' rates)"
    )
    for m in modes:
        report[m] |= {
            "live_s": live[m],
            "predicted_s": round(predicted[m], 1),
            "predicted_ratio": round(predicted[m] / live[m], 3),
            "sim_over_live": round(predicted[m] / live[m], 3),
            "own_predicted_s": round(own[m], 1),
            "own_predicted_ratio": round(own[m] / live[m], 3),
            "over_bound": round(live[m] / bound_s, 3),
        }
        print(
            f"  {m:<12} live {live[m]:7.1f} s  predicted {predicted[m]:7.1f} s ({predicted[m] / live[m]:.3f}x), "
            f"from its own run {own[m]:7.1f} s ({own[m] / live[m]:.3f}x)  live / bound {live[m] / bound_s:.3f}"
        )
    report |= bound_report(terms)
    if "elastic" in results:
        report |= compare(results, live, predicted, bound_s, modes)
        report["elastic_over_bound"] = report["elastic"]["over_bound"]
    print(jsonio.dumps(report))


def compare(results: dict, live: dict, predicted: dict, bound_s: float, modes: list[str]) -> dict:
    """Elastic against each other mode: live, at equal work, and the most a schedule could gain."""
    out = {}
    for m in (x for x in modes if x != "elastic"):
        key = m.replace("-", "_")
        out[f"speedup_vs_{key}"] = live_x = round(live[m] / live["elastic"], 3)
        # live runs train different work (uniform groups are not trained); the simulated ones do not
        out[f"equal_work_speedup_vs_{key}"] = equal_x = round(predicted[m] / predicted["elastic"], 3)
        # no schedule beats the bound: the most any could gain over this baseline's live run
        out[f"ceiling_vs_{key}"] = ceiling = round(live[m] / bound_s, 3)
        print(
            f"elastic vs {m}: {live_x}x faster (first execution to last optimizer step; "
            f"whole job {results[m]['wall_s'] / results['elastic']['wall_s']:.3f}x); "
            f"at equal work (simulated on the {modes[0]} run's workload) {equal_x}x; "
            f"a schedule at the bound: {ceiling}x"
        )
    return out


if __name__ == "__main__":
    main()
