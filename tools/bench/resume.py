"""Benchmark: what a restart costs the rollouts, continuing interrupted executions or re-running them.

One run of the embedded default (tiny model, toy agent, local cells) is SIGKILLed with its whole
process group once executions are mid-way through step `--kill-step` (its calls recorded, the step
not trained yet), as a node failure or a preemption without warning would. Its run directory is
copied twice and each copy is resumed (`resume=true`) with `coordinator.on_resume=continue` and
`=rerun`, one after the other, nothing else running. Per policy:
- tokens_after_resume: prompt + output tokens of the calls the resumed run made (records started after the resume);
- wall_after_resume_s: from the resume's start until the step that was in flight at the kill is trained;
- executions_continued, executions_rerun, tokens_kept_by_continue: the resumed run's summary.

    PYTHONPATH=. python tools/bench/resume.py [--steps 2 --kill-step 1 --seed 0] [--smoke] [-- OVERRIDES]

`--smoke`: the figures computed from a run directory written here (records, events, a summary),
without a live run (the test suite's run: seconds). Prints figures, then one JSON object on the last line.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gyre.common import jsonio

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("continue", "rerun")


def _events(run_dir: Path, kind: str) -> list[dict]:
    from gyre.common.run_paths import RunPaths

    path = RunPaths(run_dir).events
    if not path.exists():
        return []
    text = path.read_text()
    return [e for e in map(jsonio.loads, text.splitlines()[: text.count("\n")]) if e["kind"] == kind]


def _train(run_dir: Path, *extra: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gyre.launch.train", f"hydra.run.dir={run_dir}", *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )


def kill_mid_step(run_dir: Path, step: int, overrides: list[str]) -> None:
    """Run until an execution of step `step` or later is running with calls recorded and its first
    turn saved in its toy session file (what continuing needs: without it the execution is re-run),
    the steps before it trained; then SIGKILL the run's whole process group."""
    from gyre.common.run_paths import RunPaths
    from gyre.coordinator.ledger import read_ledger
    from gyre.harness.toy_agent import SESSION_FILE

    proc, paths = _train(run_dir, *overrides, start_new_session=True), RunPaths(run_dir)

    def mid_step() -> bool:
        if not paths.ledger.exists() or not any(e["step"] >= step for e in _events(run_dir, "checkpoint")):
            return False
        running = [eid for eid, e in read_ledger(paths.ledger).entries.items() if e.state == "running"]
        saved = [eid for eid in running if (paths.sandboxes / eid / "home" / SESSION_FILE).exists()]
        return any(paths.record(eid).exists() and paths.record(eid).stat().st_size > 0 for eid in saved)

    while not mid_step():
        if proc.poll() is not None:
            sys.exit(f"the run ended before step {step} was mid-way:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def measure(run_dir: Path, resumed_t: float, step: int, summary: dict) -> dict:
    """The figures of one resumed run (`resumed_t`: unix time it started)."""
    from gyre.common.run_paths import RunPaths
    from gyre.records.io import read_records

    tokens = 0
    for path in RunPaths(run_dir).records.glob("*.jsonl"):
        records, _ = read_records(path)
        tokens += sum(int(np.size(r.input_ids) + np.size(r.output_ids)) for r in records if r.started_at > resumed_t)
    trained = [e["t"] for e in _events(run_dir, "optimizer_step") if e["step"] == step and e["t"] > resumed_t]
    keys = ("executions_continued", "executions_rerun", "tokens_kept_by_continue")
    return {
        "tokens_after_resume": tokens,
        "wall_after_resume_s": round(min(trained) - resumed_t, 1) if trained else None,
    } | {k: summary.get(k) for k in keys}


def resume(run_dir: Path, policy: str, step: int, overrides: list[str]) -> dict:
    t0 = time.time()
    proc = _train(run_dir, *overrides, "resume=true", f"coordinator.on_resume={policy}")
    out, _ = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"resume ({policy}) exited {proc.returncode}:\n{out[-3000:]}")
    return measure(run_dir, t0, step, jsonio.loads(out.strip().splitlines()[-1]))


def smoke_run_dir(root: Path) -> tuple[Path, float]:
    """A run directory as a resumed run leaves it: a record before and one after the resume, the step trained."""
    from gyre.common.run_paths import RunPaths
    from gyre.records.io import RecordWriter
    from gyre.records.record import CallRecord
    from gyre.records.versions import VersionSpan

    run, t = root / "run", time.time()
    RunPaths(run).records.mkdir(parents=True)
    with RecordWriter(RunPaths(run).record("g00000-0")) as w:
        for seq, started in enumerate((t - 10, t + 1)):
            ids = np.arange(8, dtype=np.int32)
            w.append(
                CallRecord(
                    execution_id="g00000-0",
                    call_id=f"c{seq}",
                    seq=seq,
                    agent_id="main",
                    parent_agent_id=None,
                    kind_hint="main",
                    input_ids=ids,
                    output_ids=ids[:3],
                    logprobs=np.zeros(3, dtype=np.float32),
                    version_spans=(VersionSpan(0, 3, 0),),
                    finish_reason="stop",
                    started_at=started,
                    finished_at=started + 0.5,
                )
            )
    step = {"kind": "optimizer_step", "step": 1, "t": t + 5}
    RunPaths(run).events.write_text(jsonio.dumps(step) + "\n")
    return run, t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--kill-step", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="the figures from a run directory written here")
    p.add_argument("overrides", nargs="*", help="gyre-train overrides for the run (after --)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="gyre-bench-resume-") as tmp:
        if a.smoke:
            run, t = smoke_run_dir(Path(tmp))
            out = {"continue": measure(run, t, 1, {"executions_continued": 1}), "rerun": None}
        else:
            base, overrides = Path(tmp) / "base", [f"num_steps={a.steps}", f"seed={a.seed}", *a.overrides]
            kill_mid_step(base, a.kill_step, overrides)
            out = {}
            for policy in POLICIES:
                shutil.copytree(base, Path(tmp) / policy, symlinks=True)
                out[policy] = resume(Path(tmp) / policy, policy, a.kill_step, overrides)
    for policy, figures in out.items():
        print(f"{policy}: {figures}")
    print(jsonio.dumps(out))


if __name__ == "__main__":
    main()
