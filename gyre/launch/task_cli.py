"""`gyre-task`: run one execution, list a task set, check a task set's reference solutions.

    gyre-task run TASK --harness KIND [--set harness.KEY=VALUE ...] [--proxy URL --key K --records F]
    gyre-task list [TASKSET]
    gyre-task check [TASKSET]

TASKSET: a directory of *.json specs, a JSONL file, or a folder of Harbor task folders; TASK: a
task id of --taskset, or a Harbor task folder. Without --proxy, `run` starts a builtin engine
(random weights, or --model-dir) and a proxy of its own, and stops them after. Without TASKSET the
embedded toy set is used. `run` and `check` print one JSON object on their last line. `run` scores
as the coordinator does: a harness that made no model call is `excluded` (`harness_failed` if it
exited non-zero, else `no_model_calls`), never scored; --records names where --proxy counts the calls.
"""

import argparse
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import replace
from pathlib import Path

import hydra
from hydra.errors import HydraException
from omegaconf import OmegaConf

from gyre.common import CONF_DIR, jsonio
from gyre.common.run_paths import RunPaths
from gyre.config import register_configs
from gyre.engines.config import EngineConfig
from gyre.engines.launch import BuiltinEngineProcess
from gyre.errors import ConfigError, GyreError
from gyre.harness.config import ISOLATIONS, KINDS, HarnessConfig
from gyre.harness.evaluate import evaluate
from gyre.harness.podman import podman_available
from gyre.harness.sandbox import Sandbox, bwrap_available, check_isolation, make_task_workspace
from gyre.harness.steps import check_steps, wait_steps
from gyre.harness.workspace import apply_reference
from gyre.models.checkpoint import load_checkpoint
from gyre.models.config import ModelConfig
from gyre.models.tokenizer import has_bpe_tokenizer
from gyre.proxy.config import ProxyConfig
from gyre.proxy.main import ProxyProcess
from gyre.records.io import has_records
from gyre.tasks.spec import TaskSpecError
from gyre.tasks.taskset import TOY_TASKSET, TaskSet
from gyre.trajectory.rewards import Evaluation, reward_of, unscored_reason

CHECK_ATTEMPTS = 3
"""Evaluator errors are retried this often in `check` (toy evaluators fail at a configured rate)."""


def register_execution(proxy: ProxyProcess, execution_id: str) -> str:
    req = urllib.request.Request(
        proxy.url + "/admin/executions",
        data=jsonio.dumps({"execution_id": execution_id}).encode(),
        headers={"Authorization": f"Bearer {proxy.admin_token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return jsonio.loads(r.read())["api_key"]


def start_stack(args, root: Path) -> tuple[list, str, str, str]:
    """An engine and a proxy of our own: (processes to stop, proxy URL, key, records path)."""
    if args.model_dir and args.context_len:
        raise SystemExit("gyre-task run: --context-len sets the random tiny model's context; --model-dir has its own")
    model_cfg = (
        load_checkpoint(args.model_dir)[0] if args.model_dir else ModelConfig(max_seq_len=args.context_len or 32768)
    )
    engine = BuiltinEngineProcess(
        EngineConfig(model_path=args.model_dir, scripted_policy=args.scripted_policy, startup_timeout_s=300), model_cfg
    )
    engine.start()
    procs = [engine]
    try:
        proxy = ProxyProcess(
            ProxyConfig(
                records_dir=str(RunPaths(root).records),
                engines=[engine.url],
                model_names=[args.model],
                context_len=model_cfg.max_seq_len,
                temperature=args.temperature,
                tokenizer_path=args.model_dir if args.model_dir and has_bpe_tokenizer(args.model_dir) else None,
                vocab_size=model_cfg.vocab_size,
            )
        ).start()
        procs.insert(0, proxy)
        key = register_execution(proxy, args.execution_id)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs, proxy.url, key, str(RunPaths(root).record(args.execution_id))


def load_run_task(args):
    """TASK as a Harbor task folder, else as an id of --taskset."""
    if Path(args.task, "task.toml").is_file():
        return TaskSet.load(args.task).tasks[0]
    return TaskSet.load(args.taskset).get(args.task)


def harness_config(kind: str, overrides: list[str], **values) -> HarnessConfig:
    """conf/harness/KIND.yaml with `overrides` (harness.KEY=VALUE) and `values`, composed and checked
    as gyre-train does it (its mem_limit_gb: None for the Node harnesses and Codex, which reserve
    large address spaces; Node's fetch cannot start under 4 GB).

    Raises:
        ConfigError: a bad override, naming its key.
    """
    if bad := [o for o in overrides if not o.startswith("harness.")]:
        raise ConfigError("--set", f"takes harness.KEY=VALUE overrides, not {bad[0]!r}")
    register_configs()
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hydra.compose(config_name="config", overrides=[f"harness={kind}", *overrides])
    try:
        return replace(OmegaConf.to_object(cfg.harness), **values)
    except ConfigError as e:
        raise e.under("harness") from None


def cmd_run(args) -> int:
    given = {"command": args.command, "isolation": args.isolation}  # over the harness config where given
    harness = harness_config(args.harness, args.set, **{k: v for k, v in given.items() if v is not None})
    task = load_run_task(args)
    root = Path(args.root or tempfile.mkdtemp(prefix="gyre-task-")).resolve()
    args.execution_id = args.execution_id or f"{task.task_id}-{uuid.uuid4().hex[:8]}"
    procs, records = [], args.records
    if args.proxy:
        if not (args.key and args.records):
            raise SystemExit("gyre-task run: --proxy needs --key and --records (as the execution's registration gave)")
        url, key = args.proxy, args.key
    else:
        procs, url, key, records = start_stack(args, root)
    try:
        sb = Sandbox(task, args.execution_id, RunPaths(root).sandboxes, harness, url, key, args.model)
        sb.prepare()
        sb.start()
        result, steps_ev = wait_steps(sb)
        report = run_report(sb.task, result, records, sb.environment, steps_ev)
    finally:
        sb.close()
        for p in procs:
            p.stop()
    print(result.log_path.read_text(errors="replace")[-2000:], file=sys.stderr)
    print(jsonio.dumps(report | {"isolated": sb.isolated, "execution_id": args.execution_id}))
    return 0


def run_report(task, result, records: str, environment=None, steps_ev: Evaluation | None = None) -> dict:
    """The outcome of one ended harness run by the coordinator's rule: excluded unscored when it made no
    model call (`unscored_reason`), else its workspace's evaluation (a multi-step task's: `steps_ev`,
    its steps' verified in turn)."""
    reason = unscored_reason(result.exit_code, has_records(records), result.timed_out)
    if reason is not None:
        ev = Evaluation("timed_out" if result.timed_out else "finished")
    else:
        outcome = "timed_out" if result.timed_out else "finished"
        ev = steps_ev if steps_ev is not None else evaluate(task, result.workspace, outcome, environment)
        reason = reward_of(ev)[1]
    return {
        "outcome": "excluded" if reason else ev.outcome,
        "reason": reason,
        "score": ev.score,
        "records_path": records,
        "workspace": str(result.workspace),
        "duration_s": round(result.duration_s, 3),
        "exit_code": result.exit_code,
        "timed_out": result.timed_out,
        "detail": ev.detail,
        "metrics": ev.metrics,
    }


def cmd_list(args) -> int:
    for t in TaskSet.load(args.taskset).tasks:
        print(f"{t.task_id}\t{t.time_budget_s:g}s\t{t.evaluator.kind}\t{t.instruction.splitlines()[0][:80]}")
    return 0


def evaluate_retrying(task, ws: Path, environment=None) -> tuple[Evaluation, int]:
    """The first evaluation that is not an evaluator error (else the last of CHECK_ATTEMPTS), and how many ran."""
    for runs in range(1, CHECK_ATTEMPTS + 1):  # noqa: B007 - `runs` is returned: how many evaluations ran
        ev = evaluate(task, ws, "finished", environment)
        if ev.outcome != "evaluator_error":
            break
    return ev, runs


def check_task(task, root: Path) -> tuple[bool, str, float]:
    """(ok, line, evaluator seconds) for one task: an untouched workspace scores < 1, and the
    reference (a Harbor task's solution/solve.sh in its sandbox) applied to a fresh one scores 1;
    an evaluator that keeps failing on either, or a reference that cannot run, is a FAIL. A
    multi-step task's steps run in turn on each (check_steps: per step its oracle, then its verifier;
    its seconds are the oracles' too)."""
    env = None
    try:
        if task.environment is not None:
            check_isolation(task, HarnessConfig(isolation="podman"), bwrap_available(), podman_available())
        untouched = make_task_workspace(task, root / task.task_id / "untouched")
        solved = make_task_workspace(task, root / task.task_id / "reference")
        if task.steps:
            start, runs_before, runs_after = time.monotonic(), 1, 1
            before, after = check_steps(task, untouched, oracle=False), check_steps(task, solved, oracle=True)
        else:
            env = apply_reference(task, solved)
            start = time.monotonic()
            before, runs_before = evaluate_retrying(task, untouched)
            after, runs_after = evaluate_retrying(task, solved, env)
    except GyreError as e:
        return False, f"{task.task_id}\tFAIL\t{e}", 0.0
    finally:
        if env is not None:
            env.close()
    seconds = (time.monotonic() - start) / (runs_before + runs_after)
    errors = runs_before + runs_after - sum(e.outcome != "evaluator_error" for e in (before, after))
    ok = after.outcome == before.outcome == "finished" and after.score == 1.0 and before.score != 1.0
    why = "" if ok else (before if before.outcome != "finished" else after).detail
    line = (
        f"{task.task_id}\t{'ok' if ok else 'FAIL'}\tempty={before.score} reference={after.score} "
        f"eval_s={seconds:.3f}{f' evaluator_errors={errors}' if errors else ''} {why}"
    )
    return ok, line.rstrip(), seconds


def cmd_check(args) -> int:
    ts = TaskSet.load(args.taskset)
    results = []
    with tempfile.TemporaryDirectory(prefix="gyre-check-") as tmp:
        for t in ts.tasks:
            ok, line, seconds = check_task(t, Path(tmp))
            print(line, flush=True)
            results.append((ok, seconds))
    passed = sum(ok for ok, _ in results)
    print(
        jsonio.dumps(
            {
                "tasks": len(results),
                "passed": passed,
                "evaluator_s_mean": round(sum(s for _, s in results) / len(results), 4),
            }
        )
    )
    return 0 if passed == len(results) else 1


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gyre-task", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run one execution and print its evaluation")
    run.add_argument("task")
    run.add_argument("--taskset", default=TOY_TASKSET)
    run.add_argument("--harness", choices=KINDS, default="toy")
    run.add_argument(
        "--command",
        help="harness=command: the command line "
        "(placeholders: {instruction} {workspace} {proxy_url} {api_key} {model})",
    )
    run.add_argument("--proxy", help="a running proxy's URL (else an engine and a proxy are started)")
    run.add_argument("--key", help="the execution's API key on --proxy")
    run.add_argument("--records", help="the execution's records file on --proxy (its model calls are counted there)")
    run.add_argument("--model", default="gyre", help="model name the harness asks for")
    run.add_argument("--model-dir", help="own engine: weights directory (default: random tiny weights)")
    run.add_argument("--scripted-policy", help="own engine: a scripted policy file (tests, demos)")
    run.add_argument(
        "--context-len",
        type=int,
        help="own engine without --model-dir: the random tiny model's context in byte tokens (default 32768; "
        "Codex's prompt needs 65536, Qwen Code's 131072)",
    )
    run.add_argument("--temperature", type=float, default=None)
    run.add_argument("--isolation", choices=ISOLATIONS, help="default: the harness config's (auto)")
    run.add_argument("--root", help="directory for sandboxes and records (default: a new temporary one)")
    run.add_argument("--execution-id")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="harness.KEY=VALUE",
        help="override conf/harness/<kind>.yaml as gyre-train's overrides do (repeatable), "
        "e.g. --set 'harness.qwen_code_tools=[run_shell_command]'",
    )
    for name in ("list", "check"):
        s = sub.add_parser(
            name, help="list task ids" if name == "list" else "validate a set and score its reference solutions"
        )
        s.add_argument("taskset", nargs="?", default=TOY_TASKSET)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        code = {"run": cmd_run, "list": cmd_list, "check": cmd_check}[args.cmd](args)
    except (ConfigError, HydraException, TaskSpecError) as e:  # bad input, named before anything starts
        sys.exit(f"gyre-task {args.cmd}: {e}")
    sys.exit(code)


if __name__ == "__main__":
    main()
