"""The coordinator end to end: `gyre-train` on local cells with the toy agent, killed and resumed.

Scores come from a test evaluator that hashes the execution's directory name, so every group has
different rewards (something to train) whatever the tiny model writes; one task's evaluator
crashes, which must exclude its executions, never score them.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from gyre.cells.leader import ENGINE_LOST_EXIT, RANK_LOST_EXIT
from gyre.coordinator.ledger import read_ledger

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

SCORE = """import hashlib, json, os, sys
name = os.path.basename(os.path.dirname(os.getcwd()))
if "crash" in open("task.md").read():
    sys.exit("evaluator crashed")
print(json.dumps({"score": int(hashlib.sha256(name.encode()).hexdigest(), 16) % 97 / 100}))
"""


def _taskset(tmp: Path, words: tuple[str, ...] = ("apple", "river", "crash")) -> Path:
    (tmp / "score.py").write_text(SCORE)
    lines = []
    for word in words:
        lines.append(
            json.dumps(
                {
                    "task_id": f"t-{word}",
                    "instruction": f"Write the word {word} to answer.txt.",
                    "workspace": {"files": {"task.md": f"Write the word {word} to answer.txt.\n"}},
                    "setup": None,
                    "evaluator": {"kind": "json_score", "command": f"{{python}} {tmp / 'score.py'}", "timeout_s": 30},
                    "time_budget_s": 60,
                    "reference": {"files": {"answer.txt": word}},
                }
            )
        )
    (tmp / "tasks.jsonl").write_text("\n".join(lines) + "\n")
    return tmp / "tasks.jsonl"


# Small enough for 2 shared cores; the satellite leaves rollout as soon as one group is ready.
OVERRIDES = [
    "coordinator.group_size=2",
    "coordinator.groups_per_step=3",
    "coordinator.sessions_per_cell=20",
    "coordinator.train_tok_s=100",
    "harness.toy.max_tokens=16",
    "harness.toy.max_turns=2",
    "harness.toy.subagent=false",
    "harness.toy.verify=false",
    "tasks.warm_start=false",
]


def _gyre_train(run_dir: Path, tasks: Path, *extra: str, **popen) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "gyre.launch.train",
        f"hydra.run.dir={run_dir}",
        f"tasks.path={tasks}",
        *OVERRIDES,
        *extra,
    ]
    popen.setdefault("env", _env())
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def _env(**extra: str) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)


def _finish(proc: subprocess.Popen, timeout_s: float = 900) -> dict:
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def _events(run_dir: Path, kind: str) -> list[dict]:
    """The run's events of `kind` so far; a line still being written waits for the next read."""
    text = (run_dir / "events.jsonl").read_text()
    lines = text.splitlines()[: text.count("\n")]
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def _sglang_fake(tmp_path: Path) -> list[str]:
    """engine=sglang served by its CPU contract fake, dummy-loading a tiny HF directory of
    conf/model/tiny.yaml's shapes (the core's weights reach it before any call)."""
    import yaml  # PyYAML comes with Hydra

    from gyre.models.checkpoint import save_checkpoint
    from gyre.models.config import ModelConfig
    from gyre.models.transformer import init_weights

    tiny = ModelConfig(**yaml.safe_load((ROOT / "conf" / "model" / "tiny.yaml").read_text()))
    save_checkpoint(tmp_path / "tiny", tiny, init_weights(tiny, 0))
    return [
        "engine=sglang",
        "engine.sglang_fake=true",
        f"engine.model_path={tmp_path / 'tiny'}",
        "engine.load_format=dummy",
        "engine.enable_hicache=true",  # the fake's L3 store (GYRE_SGLANG_FAKE_L3_DIR) carries KV across hand-offs
        "engine.mooncake_master=127.0.0.1:1",
        "engine.page_size=1",  # SGLang's /get_model_info does not say its page size: the proxy assumes 1
        "engine.startup_timeout_s=120",
    ]


def test_two_steps_train_switch_roles_checkpoint_and_exclude_a_crashing_evaluator(tmp_path):
    """Served by SGLang's contract fake (the builtin engine runs in the other runs here): every
    cell's server speaks only SGLang's routes, weights reach it by update_weights_from_distributed
    over gloo (the fake refuses Gyre's Mooncake load), and every call carries `extra_key` = the
    version the engine served when the call arrived, the calls after the update included."""
    run_dir, audit = tmp_path / "run", tmp_path / "generate.jsonl"
    summary = _finish(
        _gyre_train(
            run_dir,
            _taskset(tmp_path),
            "num_steps=2",
            "scheduler.staleness=0",  # step 1's executions start under version 1: calls after an update
            # A run of seconds: the leave rule weighs the present, not the peak decode demand of a
            # 5-minute window (the first calls' burst kept both satellites serving), and a step's
            # second micro-step (~2.3K tokens), unclaimed while the core computes its first, is worth
            # a satellite's round trip (gain_factor x 12 s) at 20 tok/s.
            "scheduler.leave_window_s=0",
            "coordinator.train_tok_s=20",
            *_sglang_fake(tmp_path),
            env=_env(GYRE_SGLANG_FAKE_AUDIT=str(audit), GYRE_SGLANG_FAKE_L3_DIR=str(tmp_path / "l3")),
        )
    )
    audited = [json.loads(line) for line in audit.read_text().splitlines()]
    calls = [a for a in audited if "rid" in a]
    assert calls and all(c["extra_key"] == c["weight_version"] for c in calls), calls
    updates = [a for a in audited if a.get("exclusive") == "update_weights_from_distributed"]
    assert updates and all(u["paused"] for u in updates), audited  # generation paused first: no wait on calls
    # Version-1 calls: a serving engine loaded the update in place, held and re-keyed by the proxy
    # (at the publish, or on its return from training: which one depends on timing, so not asserted).
    assert {"0", "1"} <= {c["weight_version"] for c in calls}

    assert summary["num_steps"] == 2 and summary["run_dir"] == str(run_dir)
    assert summary["kv_reprefill_tokens"] == 0 and summary["kv_migrated_tokens"] >= 0  # hand-offs moved all KV
    view = read_ledger(run_dir / "ledger.jsonl")
    assert len(view.history) == 2 * 3 * 2 and view.num_torn == 0
    for eid, entries in view.history.items():
        states = [e.state for e in entries]
        assert states[:2] == ["queued", "running"] and view.outcome(eid) is not None, (eid, states)
        if entries[0].task_id == "t-crash":
            assert view.outcome(eid).reason == "evaluator_error" and "trained" not in states
    counts = view.counts()
    assert counts["trained"] > 0 and counts["excluded/evaluator_error"] >= 1
    assert summary["executions"]["trained"] == counts["trained"]
    assert sorted(p.name for p in (run_dir / "records").glob("*.jsonl")) == sorted(f"{e}.jsonl" for e in view.history)
    assert (run_dir / "checkpoints" / "step_00000002").is_dir()

    switches = _events(run_dir, "role_switch")
    assert summary["num_role_switches"] == len(switches) >= 1
    to_train = next(s for s in switches if s["to_role"] == "train")
    assert list(to_train["phases"]) == [
        "stop_admission",
        "hand_off_sessions",
        "release_engine_memory",
        "onload_trainer",
        "pull_weights",
        "join_step",
    ]
    assert all(v > 0 for v in to_train["phases"].values())
    # A micro-step's event is stamped when it ended: the core computes one after another, so its
    # busy time while training is the sum of its micro-steps' seconds, not the longest of a step's.
    from gyre.metrics.report import load_run

    core_s = sum(e["seconds"] for e in _events(run_dir, "micro_step") if e["cell"] == 0)
    assert load_run(run_dir)[0].busy_s(0, "train") == pytest.approx(core_s, rel=0.02) and core_s > 0

    # What people look at, from this run's events: TensorBoard scalars, the figures, gyre-report.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gyre.metrics.report import main as report_main

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    steps = _events(run_dir, "optimizer_step")
    assert [s.step for s in acc.Scalars("tokens/targets_naive")] == [e["step"] for e in steps] == [0, 1]
    assert [s.value for s in acc.Scalars("tokens/targets_dedup")] == [e["targets_dedup"] for e in steps]
    assert all(e["targets_naive"] >= e["targets_capped"] >= e["targets_dedup"] > 0 for e in steps)
    figures = {"timeline.png", "reward.png", "tokens.png", "utilisation.png"}
    assert figures <= {p.name for p in run_dir.glob("*.png")}
    assert report_main([str(run_dir)]) == 0


def _checkpointed(run_dir: Path, step: int) -> bool:
    """Step `step` - 1 trained, its checkpoint complete and announced."""
    return (run_dir / "events.jsonl").exists() and any(e["step"] == step for e in _events(run_dir, "checkpoint"))


def _wait_for(proc: subprocess.Popen, ready, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-4000:]
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed mid-run"


def _kill_when(proc: subprocess.Popen, ready) -> None:
    """SIGKILL the run (started with start_new_session) once `ready()`: the coordinator and every
    process of its session, as a node failure would."""
    _wait_for(proc, ready)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _children(run_dir: Path, cell: int, module: bytes) -> list[int]:
    """The `python -m module` children of local cell `cell`'s leader in the run in `run_dir`."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if module not in (proc / "cmdline").read_bytes():
                continue
            ppid = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
            leader = Path(f"/proc/{ppid}/cmdline").read_bytes().split(b"\0")
            spec = json.loads(Path(leader[leader.index(b"gyre.cells.leader") + 1].decode()).read_text())
        except (OSError, ValueError, IndexError):  # not ours, or gone meanwhile
            continue
        if spec["index"] == cell and spec["run_dir"] == str(run_dir):
            pids.append(int(proc.name))
    return pids


def _running(ledger: Path) -> list[str]:
    """Executions whose latest ledger state is `running` (started, no outcome yet)."""
    view = read_ledger(ledger) if ledger.exists() else None
    return [eid for eid, e in view.entries.items() if e.state == "running"] if view else []


def _assert_nothing_left(run_dir: Path, timeout_s: float = 30) -> None:
    """No process of the run (one writing a log of `run_dir`) outlives it by more than `timeout_s`."""
    logs, deadline = str(run_dir / "logs"), time.monotonic() + timeout_s
    while True:
        left = []
        for fd in Path("/proc").glob("[0-9]*/fd/[12]"):
            try:
                if os.readlink(fd).startswith(logs):
                    left.append((fd.parts[2], (fd.parent.parent / "cmdline").read_bytes()[:200]))
            except OSError:  # gone meanwhile
                continue
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, left


def _descendants(pid: int) -> set[int]:
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):  # gone meanwhile
            continue
    out, grew = {pid}, True
    while grew:
        new = {p for p, pp in parent.items() if pp in out} - out
        out, grew = out | new, bool(new)
    return out - {pid}


def _assert_no_secret_on_argv(run_dir: Path, coordinator: int, timeout_s: float = 120) -> None:
    """No process of the run carries the proxy's admin token or an execution's key on its command
    line (world-readable on a shared node): its cell leaders, proxy workers and harnesses, each
    seen running at least once."""
    token = json.loads((run_dir / "logs" / "cell0.spec.json").read_text())["proxy_admin_token"].encode()
    kinds = {b"gyre.cells.leader": "leader", b"gyre.proxy.main": "proxy worker", b"gyre.harness.toy_agent": "harness"}
    seen, deadline = set(), time.monotonic() + timeout_s
    while len(seen) < len(kinds):
        assert time.monotonic() < deadline, f"saw only {seen} running"
        for pid in _descendants(coordinator):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            kind = next((k for m, k in kinds.items() if m in argv), None)
            if kind is not None:
                assert token not in argv and not re.search(rb"gyre-[\w-]{32}", argv), (kind, argv[:400])  # a key
                seen.add(kind)
        time.sleep(0.1)


def _rank1_pid(run_dir: Path, cell: int) -> int:
    """Rank 1 of local cell `cell`: the `gyre.train.ranks` child of its leader."""
    (pid,) = _children(run_dir, cell, b"gyre.train.ranks")
    return pid


def test_cells_of_two_ranks_serve_through_two_engines_and_killed_ranks_lose_a_satellite_then_stop_the_run(tmp_path):
    """Cells of two ranks on two emulated nodes serve through an engine per node. SIGKILL an engine of
    the serving satellite and that cell is lost at once (its leader watches the engines it started;
    a follower rank's on Slurm, test_slurm.py) while the run trains on: the training satellite comes
    back to serve, its switches having drained, released, reloaded and announced both its engines,
    each rank's phase times recorded. SIGKILL rank 1 of the core while an execution runs and the run
    stops (its leader exits at once, not after gloo's timeout); the resumed run continues the
    interrupted executions' toy-agent sessions (one call tree across the break) and loses and
    retrains nothing. Then recovery parity: the run's records
    replayed by a two-rank core that is SIGKILLed and resumed train the run's weights bit for bit."""
    run_dir, tasks = tmp_path / "run", _taskset(tmp_path)
    # executions of seconds: one the kill below finds running is still running when the run stops
    cells = ("cluster.ranks_per_cell=2", "cluster.cell_nodes=2", *_two_commands(tmp_path))
    proc = _gyre_train(run_dir, tasks, "num_steps=4", *cells, start_new_session=True)
    try:
        _wait_for(proc, lambda: _checkpointed(run_dir, 1) and _satellite_roles(run_dir) == ["rollout", "train"])
        assert all(len(_children(run_dir, k, b"gyre.engines.server")) == 2 for k in range(3))  # one per node
        _assert_no_secret_on_argv(run_dir, proc.pid)
        roles = _events(run_dir, "observation")[-1]["roles"]
        serving, training = roles.index("rollout"), roles.index("train", 1)
        killed_t = time.time()
        os.kill(_children(run_dir, serving, b"gyre.engines.server")[-1], signal.SIGKILL)
        _wait_for(proc, lambda: _checkpointed(run_dir, 2))  # trained on without it
        engines = {e["engine_id"]: e for e in _proxy_engines(run_dir)}
        back = [engines[f"cell{training}"], engines[f"cell{training}.e1"]]  # the cell's engines, under it
        assert all(e["status"] == "active" and e["weight_version"] >= 2 for e in back), back  # reloaded, announced
        assert {e["cell_id"] for e in back} == {str(training)}
        lost = [e for e in _events(run_dir, "failure") if e["component"] == f"cell{serving}"]
        assert lost and lost[0]["t"] - killed_t < 15, lost  # found at once, not at the next switch
        if f"exited with code {ENGINE_LOST_EXIT}" in lost[0]["message"]:  # by its leader's watch (0.5 s)
            log = (run_dir / "logs" / f"cell{serving}.log").read_text()
            assert f"cell {serving}: its engine http://" in log and "exited with code -9; the cell is lost" in log
        else:  # a step ended first (a loaded box): the weight push to the dead engine found it
            assert "its engine did not take weight version" in lost[0]["message"], lost
        # Step 3's executions are admitted once step 1 is applied (staleness 1): kill while one runs.
        _wait_for(proc, lambda: _running(run_dir / "ledger.jsonl"))
        os.kill(_rank1_pid(run_dir, 0), signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the coordinator; its children die with it (PR_SET_PDEATHSIG)
    assert proc.returncode != 0 and f"exited with code {RANK_LOST_EXIT}" in out, out[-4000:]
    assert "cell 0: rank 1 exited with code -9" in (run_dir / "logs" / "cell0.log").read_text()
    _assert_nothing_left(run_dir)  # engines, ranks, megatron's checkpoint queue: gone with their leaders
    _assert_both_engines_switched(run_dir, training)
    before = read_ledger(run_dir / "ledger.jsonl")
    saved = {e["step"]: e["weights_digest"] for e in _events(run_dir, "checkpoint")}

    in_flight = _running(run_dir / "ledger.jsonl")
    assert in_flight  # at least one execution was running when the core died

    summary = _finish(_gyre_train(run_dir, tasks, "num_steps=4", *cells, "resume=true"))
    view = read_ledger(run_dir / "ledger.jsonl")
    start = _events(run_dir, "run_start")[-1]
    assert start["weights_digest"] == saved[start["start_step"]]  # the weights are the checkpoint's
    assert start["start_step"] >= 2
    trained = Counter(e.execution_id for es in view.history.values() for e in es if e.state == "trained")
    assert trained and max(trained.values()) == 1  # none trained twice
    steps = {e.step for es in view.history.values() for e in es if e.state == "trained"}
    assert steps == {0, 1, 2, 3}
    # What ran at the kill continued its toy agent's session under the same id where it had saved
    # one (test_interrupted_executions_continue...), else was re-run; every execution reached an outcome.
    continued = [eid for eid in in_flight if any(e.reason == "continued" for e in view.history[eid])]
    assert all(view.outcome(f"{eid}.r1") is not None for eid in in_flight if eid not in continued)
    assert all(view.outcome(eid).reason == "interrupted" for eid in in_flight if eid not in continued)
    assert summary["executions_continued"] == len(continued)
    assert all(view.outcome(eid) is not None for eid in view.history)
    assert before.history.keys() <= view.history.keys() and summary["num_steps"] == 4
    assert summary["cell_ranks"] == 2  # resumed with the same cells: the 2-rank checkpoint (Adam sharded) loaded
    assert all(len(v) == 2 for v in summary["rank_switch_phase_s"][str(training)].values())  # both runs' events

    # Recovery parity: replayed by one core cell of two data-parallel ranks, SIGKILLed after step 1's
    # checkpoint and resumed (the run above resumed once already), its records train the run's weights.
    replay = tmp_path / "replay"
    records = [f"records={run_dir / 'records'}", "mode=replay", "cluster.num_cells=1", "cluster.ranks_per_cell=2"]
    proc = _gyre_train(replay, tasks, "num_steps=3", *records, start_new_session=True)
    _kill_when(proc, lambda: _checkpointed(replay, 1))
    replayed = _finish(_gyre_train(replay, tasks, "num_steps=3", *records, "resume=true"))
    assert [e["start_step"] for e in _events(replay, "run_start")] == [0, 1]
    digests = [{e["step"]: e["weights_digest"] for e in _events(d, "checkpoint")} for d in (run_dir, replay)]
    assert {s: digests[0][s] for s in (1, 2, 3)} == digests[1] and sorted(digests[1]) == [1, 2, 3]
    # A group packs into a micro-batch per data-parallel replica, so both core ranks computed in each.
    assert replayed["cell_ranks"] == 2
    assert all({e["rank"] for e in _events(d, "micro_step") if e["cell"] == 0} == {0, 1} for d in (run_dir, replay))


def _mid_way_calls(records: list) -> bool:
    """A sub-agent's call and two of the main agent's (its first turn saved) are recorded."""
    main = sum(r.parent_agent_id is None for r in records)
    return any(r.parent_agent_id is not None for r in records) and main >= 2


def _mid_way(run_dir: Path, beside_finished: bool = False) -> bool:
    """A running execution is mid-way (`_mid_way_calls`); `beside_finished`: one of its group's has ended."""
    view = read_ledger(run_dir / "ledger.jsonl") if (run_dir / "ledger.jsonl").exists() else None
    for eid in _running(run_dir / "ledger.jsonl"):
        group = view.history[eid][0].group
        ended = any(es[0].group == group and view.outcome(other) for other, es in view.history.items())
        if _mid_way_calls(_records(run_dir, eid)) and (ended or not beside_finished):
            return True
    return False


def _records(run_dir: Path, eid: str) -> list:
    from gyre.records.io import read_records

    path = run_dir / "records" / f"{eid}.jsonl"
    return read_records(path)[0] if path.exists() else []


def _assert_one_tree_across_the_break(run_dir: Path, view, continued: list[str]) -> None:
    """Each continued execution made calls after the break (or its agent had ended its work before
    the kill and only its evaluation was missing), and some call after a break continues a
    conversation from before it: one tree across the break."""
    from gyre.harness.toy_agent import SESSION_FILE
    from gyre.trajectory.tree import build_call_tree

    spanning = 0
    for eid in continued:
        resumed_t = max(e.t for e in view.history[eid] if e.reason == "continued")
        tree = build_call_tree(_records(run_dir, eid))
        after = [n for n in tree.nodes if n.record.started_at > resumed_t]
        session = json.loads((run_dir / "sandboxes" / eid / "home" / SESSION_FILE).read_text())
        assert after or session["num_calls"] == len(tree.nodes), f"{eid}: no call after the break"
        spanning += any(n.parent is not None and tree.nodes[n.parent].record.started_at < resumed_t for n in after)
    assert spanning, "no call after a break continued a conversation from before it"


def _group_trained_with_fresh(view, group: int) -> bool:
    entries = [es for es in view.history.values() if es[0].group == group]
    trained = [es for es in entries if any(e.state == "trained" for e in es)]
    return any(any(e.reason == "continued" for e in es) for es in trained) and any(
        not any(e.reason == "continued" for e in es) for es in trained
    )


def _satellite_roles(run_dir: Path) -> list[str]:
    observations = _events(run_dir, "observation")
    return sorted(observations[-1]["roles"][1:]) if observations else []


def _assert_both_engines_switched(run_dir: Path, cell: int) -> None:
    """Satellite `cell` switched to train and back through both its engines (a phase time per rank,
    the cell's its slowest rank's), and neither engine took a call between its drain and its return."""
    switches = sorted((e for e in _events(run_dir, "role_switch") if e["cell"] == cell), key=lambda e: e["t"])
    assert [e["to_role"] for e in switches[:2]] == ["train", "rollout"], switches
    for e in switches:
        assert list(e["rank_phases"]) == list(e["phases"])
        assert all(len(v) == 2 and max(v) == e["phases"][p] for p, v in e["rank_phases"].items()), e
    drained, back = switches[:2]
    calls = [c for c in _events(run_dir, "model_call") if c["cell"] == cell]
    assert not [c for c in calls if drained["t"] < c["t"] - c["latency_s"] and c["t"] < back["t_start"]]


def _proxy_engines(run_dir: Path) -> list[dict]:
    """The engines the proxy of the run in `run_dir` routes to (/admin/metrics), found through a
    cell leader's spec (its proxy's address and admin token)."""
    spec = json.loads((run_dir / "logs" / "cell0.spec.json").read_text())
    auth = {"Authorization": f"Bearer {spec['proxy_admin_token']}"}
    request = urllib.request.Request(spec["proxy_url"] + "/admin/metrics", headers=auth)
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.load(reply)["engines"]


def _tool_call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


# Scripted policies (gyre.engines.scripted): the harness writes the answer with its shell tool, then stops.
HARNESS_RULES = {
    "claude_code": [
        {
            "match": "answer.txt",
            "emit": _tool_call("Bash", {"command": "printf apple > answer.txt", "description": "answer"}),
        },
        {"match": ".", "emit": "Done: answer.txt holds the word."},
    ],
    "mini_swe_agent": [
        {"match": "Please solve this issue", "emit": _tool_call("bash", {"command": "printf apple > answer.txt"})},
        {
            "match": ".",
            "emit": "Submitting. " + _tool_call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}),
        },
    ],
    "codex": [
        {"match": "answer.txt", "emit": _tool_call("exec_command", {"cmd": "printf apple > answer.txt"})},
        {"match": ".", "emit": "Done: answer.txt holds the word."},
    ],
}


@pytest.mark.parametrize("harness", ["claude_code", "mini_swe_agent", "codex"])
def test_real_harnesses_roll_out_through_the_coordinator(tmp_path, harness):
    from gyre.harness.agents import find_claude_code, find_codex, find_mini_swe_agent
    from gyre.records.io import read_records
    from gyre.trajectory.tree import build_call_tree

    finders = {"claude_code": find_claude_code, "mini_swe_agent": find_mini_swe_agent, "codex": find_codex}
    if finders[harness]() is None:
        pytest.skip(f"{harness} is not installed: run tools/setup.sh")
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": HARNESS_RULES[harness]}))
    run_dir = tmp_path / "run"
    # Real harness prompts are long (byte tokenizer; codex's is 25K tokens): a rollout-only job with a
    # longer context, its two executions on two cells of 0.75 CPU each (the default 0.5: 2 x 25 s prefills)
    summary = _finish(
        _gyre_train(
            run_dir,
            _taskset(tmp_path, ("apple",)),
            "num_steps=1",
            "mode=rollout",
            "cluster.num_cells=2",
            "coordinator.cpus_per_cell=0.75",
            f"harness={harness}",
            "coordinator.groups_per_step=1",
            "model.max_seq_len=65536",
            f"engine.scripted_policy={rules}",
        )
    )
    view = read_ledger(run_dir / "ledger.jsonl")
    assert summary["executions"].get("finished") == 2 and summary["executions"].get("trained", 0) == 0, summary
    for eid in view.history:
        records, stats = read_records(run_dir / "records" / f"{eid}.jsonl")
        tree = build_call_tree(records)
        assert len(records) >= 2 and stats.num_torn == 0 and not tree.missing_seqs
        assert (run_dir / "sandboxes" / eid / "workspace" / "answer.txt").read_text() == "apple"


# A harness (harness=command) that misbehaves the way its task asks; otherwise it asks the model once.
AGENT = """import pathlib, sys, openai
instruction, url, key, model, outside = sys.argv[1:6]
if "exit" in instruction:
    sys.exit(3)  # crashes before its first model call
if "silent" in instruction:
    pathlib.Path("answer.txt").write_text("done without the model")
    sys.exit(0)
if "escape" in instruction:
    try:
        pathlib.Path(outside).write_text("escaped")
    except OSError as e:
        print("refused:", e)
reply = openai.OpenAI(base_url=url + "/v1", api_key=key).chat.completions.create(
    model=model, max_tokens=8, messages=[{"role": "user", "content": instruction}])
pathlib.Path("answer.txt").write_text(reply.choices[0].message.content or "")
"""


def test_misbehaving_harnesses_and_a_broken_task_are_excluded_and_counted_while_the_run_trains(tmp_path):
    tasks = _taskset(tmp_path, ("apple", "river", "escape", "exit", "silent"))
    (tmp_path / "broken.tar.gz").write_bytes(b"\x1f\x8b not a whole archive")  # present, its files are not
    lines = tasks.read_text().splitlines()
    broken = json.loads(lines[0]) | {"task_id": "t-broken", "workspace": {"tar": "broken.tar.gz"}}
    tasks.write_text("\n".join([*lines, json.dumps(broken)]) + "\n")
    (tmp_path / "agent.py").write_text(AGENT)
    outside = tmp_path / "escaped.txt"
    command = f"{sys.executable} {tmp_path / 'agent.py'} {{instruction}} {{proxy_url}} {{api_key}} {{model}} {outside}"
    run_dir = tmp_path / "run"
    summary = _finish(
        _gyre_train(
            run_dir,
            tasks,
            "num_steps=1",
            "coordinator.groups_per_step=6",
            "harness=command",
            f"harness.command='{command}'",
            "harness.isolation=bwrap",
        )
    )

    view = read_ledger(run_dir / "ledger.jsonl")
    reasons = {view.history[eid][0].task_id: view.outcome(eid).reason for eid in view.history}
    assert reasons["t-exit"] == "harness_failed" and reasons["t-silent"] == "no_model_calls"
    assert reasons["t-broken"] == "sandbox_error"
    exits = {e.task_id: e.exit_code for es in view.history.values() for e in es if e.exit_code is not None}
    assert exits["t-exit"] == 3 and exits["t-silent"] == 0
    escaped = [eid for eid in view.history if view.history[eid][0].task_id == "t-escape"]
    # the sandbox's /tmp is its own (gyre/harness/roots.py): the write landed there, never on the host
    assert not outside.exists() and all(view.outcome(eid).state == "finished" for eid in escaped)
    counts = summary["executions"]
    assert (
        counts["excluded/harness_failed"] == counts["excluded/no_model_calls"] == counts["excluded/sandbox_error"] == 2
    )
    assert summary["num_steps"] == 1 and counts["trained"] == 6  # apple, river and escape: 3 groups of 2


def _two_commands(tmp_path: Path) -> tuple[str, ...]:
    """Overrides under which the main agent runs two commands of ~0.5 s before it answers (a scripted
    policy emits the calls; tool times seeded per execution, spread, so a group's executions drift
    apart): an execution lasts seconds, and a kill finds executions mid-way."""
    rules = tmp_path / "rules.json"
    script = [("Write the word", "echo STEP-ONE"), ("STEP-ONE", "echo STEP-TWO")]
    rules.write_text(
        json.dumps({"rules": [{"match": m, "emit": _tool_call("run", {"command": c})} for m, c in script]})
    )
    return (
        "harness.toy.max_turns=3",
        "harness.toy.max_tokens=96",  # room for a scripted tool call
        "harness.toy.tool_median_s=0.5",
        "harness.toy.tool_sigma=1",
        "harness.toy.tool_max_s=3",
        f"engine.scripted_policy={rules}",
    )


def test_interrupted_executions_continue_their_sessions_after_a_sigkill(tmp_path):
    """SIGKILL the coordinator and its cells while toy executions are mid-way (a sub-agent's and two
    of the main agent's calls recorded) and resume: they continue under the same id (no `.r1`),
    their calls before and after the break one call tree, the tokens before the break kept;
    nothing is trained twice, and a group of continued and uninterrupted executions trains."""
    run_dir, tasks = tmp_path / "run", _taskset(tmp_path, ("apple", "river"))  # no crashing evaluator
    toy = (*_two_commands(tmp_path), "harness.toy.subagent=true", "num_steps=2")
    proc = _gyre_train(run_dir, tasks, *toy, start_new_session=True)
    _kill_when(proc, lambda: _mid_way(run_dir, beside_finished=True))
    in_flight = _running(run_dir / "ledger.jsonl")
    assert any(_mid_way_calls(_records(run_dir, eid)) for eid in in_flight)  # a sub-agent's calls among them

    summary = _finish(_gyre_train(run_dir, tasks, *toy, "resume=true"))
    view = read_ledger(run_dir / "ledger.jsonl")
    continued = [eid for eid in in_flight if any(e.reason == "continued" for e in view.history[eid])]
    assert continued and summary["executions_continued"] == len(continued) and summary["tokens_kept_by_continue"] > 0
    assert all(view.outcome(eid) is not None and f"{eid}.r1" not in view.history for eid in continued)
    _assert_one_tree_across_the_break(run_dir, view, continued)
    trained = Counter(e.execution_id for es in view.history.values() for e in es if e.state == "trained")
    assert trained and max(trained.values()) == 1  # none trained twice
    groups = {view.history[eid][0].group for eid in continued}
    assert any(_group_trained_with_fresh(view, g) for g in groups)  # continued and uninterrupted, trained together
    assert summary["num_steps"] == 2
