"""Sandbox start-up overhead (plain, bubblewrap, bubblewrap with a Harbor task's paths, podman with a
Harbor task's image), evaluator time per toy task and of a Harbor verifier (bubblewrap, podman),
and the toy profile's duration distribution (tool calls drawn from the harness config's log-normal).

    python tools/bench/tasks.py [--runs N]      # last line: one JSON object
    python tools/bench/tasks.py --smoke         # the test suite's run: one start per isolation, 200 draws

Overhead is measured side by side in one run: the same trivial harness (`true`) started through
Sandbox.prepare/start/wait with isolation none and bwrap, and for tests/harbor_tasks/hello-file
(fresh root, workdir, masked task folder, its cpus cgroup), and, where podman runs, for
tests/harbor_image_tasks/hello-image with isolation=podman (the workspace copied from the image,
the container, the relay pair; its image built once before timing, on tools/podman-test-image's
local Debian), interleaved; CPU time from /proc (children's user+sys via os.times) and wall
time are both reported (podman's conmon is not our child: its CPU is not counted).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from gyre.common import jsonio
from gyre.common.run_paths import RunPaths
from gyre.harness.config import HarnessConfig
from gyre.harness.evaluate import evaluate
from gyre.harness.podman import ensure_image, podman_available
from gyre.harness.sandbox import Sandbox, bwrap_available, make_task_workspace
from gyre.harness.toy_agent import ToolTime
from gyre.harness.workspace import apply_reference, make_workspace
from gyre.tasks.taskset import TaskSet, toy_taskset


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's waited-for children (from /proc, 10 ms ticks)."""
    t = os.times()
    return t.children_user + t.children_system


ROOT = Path(__file__).resolve().parents[2]
HARBOR_TASK = ROOT / "tests" / "harbor_tasks" / "hello-file"
IMAGE_TASK = ROOT / "tests" / "harbor_image_tasks" / "hello-image"


def start_cost(task, root: Path, isolation: str) -> tuple[float, float]:
    """(wall s, children CPU s) of one prepare + start + wait of a harness that does nothing."""
    cfg = HarnessConfig(kind="command", command="true", isolation="auto" if isolation == "harbor" else isolation)
    cpu0, t0 = children_cpu_s(), time.perf_counter()
    sb = Sandbox(task, f"b-{uuid.uuid4().hex[:8]}", root, cfg, "http://127.0.0.1:9", "k", "gyre")
    sb.prepare()
    sb.start()
    sb.wait(poll_interval_s=0.001)
    cost = time.perf_counter() - t0, children_cpu_s() - cpu0
    sb.close()  # a Harbor task's environment (holder or container) outlives the harness until closed
    return cost


def toy_executions(ts, n: int, model_dir: str | None) -> dict:
    """Durations of `n` toy-agent executions run concurrently through one engine and proxy."""
    from gyre.engines.config import EngineConfig
    from gyre.engines.launch import BuiltinEngineProcess
    from gyre.launch.task_cli import register_execution
    from gyre.models.config import ModelConfig
    from gyre.proxy.config import ProxyConfig
    from gyre.proxy.main import ProxyProcess
    from gyre.records.io import read_records

    with tempfile.TemporaryDirectory(prefix="gyre-bench-toy-") as tmp:
        engine = BuiltinEngineProcess(EngineConfig(model_path=model_dir, startup_timeout_s=300), ModelConfig())
        engine.start()
        proxy = ProxyProcess(
            ProxyConfig(
                records_dir=str(RunPaths(tmp).records), engines=[engine.url], model_names=["gyre"], context_len=4096
            )
        ).start()
        try:
            boxes = []
            for i in range(n):
                ex = f"toy-{i}"
                sb = Sandbox(
                    ts.pick(0, i),
                    ex,
                    Path(tmp) / "sb",
                    HarnessConfig(),
                    proxy.url,
                    register_execution(proxy, ex),
                    "gyre",
                )
                sb.prepare()
                sb.start()
                boxes.append(sb)
            results = {}
            while len(results) < n:
                for sb in boxes:
                    if sb.execution_id not in results and (r := sb.poll()) is not None:
                        results[sb.execution_id] = r
                time.sleep(0.05)
            calls = [len(read_records(RunPaths(tmp).record(ex))[0]) for ex in results]
        finally:
            proxy.stop()
            engine.stop()
    d = [r.duration_s for r in results.values()]
    timed_out = sum(r.timed_out for r in results.values())
    print(
        f"toy executions ({n} concurrent): p50 {pct(d, 0.5):.1f} s, p90 {pct(d, 0.9):.1f} s, max {max(d):.1f} s, "
        f"timed out {timed_out}, model calls per execution {sorted(calls)}"
    )
    return {
        "exec_calls_mean": round(sum(calls) / n, 2),
        "exec_p50_s": round(pct(d, 0.5), 2),
        "exec_p90_s": round(pct(d, 0.9), 2),
        "exec_max_s": round(max(d), 2),
        "exec_timed_out": timed_out,
    }


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def podman_task():
    """hello-image with its image built (not part of the timings), or None where podman cannot run."""
    if not podman_available() or subprocess.run([ROOT / "tools" / "podman-test-image"], capture_output=True).returncode:
        print("podman: not measured (podman cannot run here, or tools/podman-test-image failed)")
        return None
    task = TaskSet.load(IMAGE_TASK).tasks[0]
    ensure_image(task)
    return task


def verifier_ms(task, root: Path) -> float:
    ws = make_task_workspace(task, root / f"verifier-{task.task_id}")
    t0 = time.perf_counter()
    evaluate(task, ws, "finished")
    return round((time.perf_counter() - t0) * 1e3, 1)


def start_costs(task, root: Path, runs: int) -> dict:
    """Median wall and mean children CPU ms of sandbox start-up, per isolation, interleaved."""
    image_task = podman_task() if bwrap_available() else None
    tasks = {"none": task}
    if bwrap_available():
        tasks |= {"bwrap": task, "harbor": TaskSet.load(HARBOR_TASK).tasks[0]}
    if image_task is not None:
        tasks["podman"] = image_task
    costs, out = {m: [] for m in tasks}, {}
    for _ in range(runs):
        for m, t in tasks.items():
            costs[m].append(start_cost(t, root, m))
    for m in tasks:
        wall, cpu = statistics.median(c[0] for c in costs[m]), sum(c[1] for c in costs[m]) / runs  # CPU: 10 ms ticks
        out[f"start_{m}_wall_ms"], out[f"start_{m}_cpu_ms"] = round(wall * 1e3, 2), round(cpu * 1e3, 2)
        print(f"sandbox start ({m}): median wall {wall * 1e3:.1f} ms, children CPU {cpu * 1e3:.1f} ms over {runs} runs")
    if "bwrap" in tasks:
        out["bwrap_over_plain_wall"] = round(out["start_bwrap_wall_ms"] / out["start_none_wall_ms"], 2)
        out["harbor_verifier_ms"] = verifier_ms(tasks["harbor"], root)
        print(f"harbor verifier (hello-file, bubblewrap): {out['harbor_verifier_ms']} ms")
    if "podman" in tasks:
        out["podman_over_harbor_wall"] = round(out["start_podman_wall_ms"] / out["start_harbor_wall_ms"], 2)
        out["podman_verifier_ms"] = verifier_ms(image_task, root)
        print(f"harbor verifier (hello-image, podman): {out['podman_verifier_ms']} ms")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--draws", type=int, default=20000, help="tool-duration draws for the toy profile")
    p.add_argument("--executions", type=int, default=0, help="also run this many toy executions (engine + proxy)")
    p.add_argument("--model-dir", default=None, help="engine weights for --executions (default: random tiny)")
    p.add_argument("--smoke", action="store_true", help="smallest sizes, seconds (the test suite's run)")
    a = p.parse_args()
    if a.smoke:
        a.runs, a.draws = 1, 200
    ts = toy_taskset()
    task = ts.tasks[0]
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="gyre-bench-tasks-") as tmp:
        out.update(start_costs(task, Path(tmp) / "sb", a.runs))
        evals, cpu0 = [], children_cpu_s()
        for t in ts.tasks:
            ws = make_workspace(t.workspace, Path(tmp) / "ev" / t.task_id)
            apply_reference(t, ws)
            t0 = time.perf_counter()
            evaluate(t, ws, "finished")
            evals.append(time.perf_counter() - t0)
        out["evaluator_ms_median"], out["evaluator_ms_max"] = (
            round(statistics.median(evals) * 1e3, 1),
            round(max(evals) * 1e3, 1),
        )
        out["evaluator_cpu_ms_mean"] = round((children_cpu_s() - cpu0) / len(evals) * 1e3, 1)
        print(
            f"toy evaluator: median wall {out['evaluator_ms_median']} ms, max {out['evaluator_ms_max']} ms, "
            f"mean CPU {out['evaluator_cpu_ms_mean']} ms per task ({len(evals)} tasks)"
        )
    t = HarnessConfig().toy
    tool, rng = ToolTime(t.tool_median_s, t.tool_sigma, t.tool_max_s), __import__("random").Random(0)
    draws = [tool.draw(rng) for _ in range(a.draws)]
    for q, name in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
        out[f"tool_{name}_s"] = round(pct(draws, q), 3)
    out["tool_max_s"] = round(max(draws), 3)
    print(
        f"toy tool durations ({a.draws} draws): p50 {out['tool_p50_s']} s, p90 {out['tool_p90_s']} s, "
        f"p99 {out['tool_p99_s']} s, max {out['tool_max_s']} s"
    )
    if a.executions:
        out.update(toy_executions(ts, a.executions, a.model_dir))
    print(jsonio.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
