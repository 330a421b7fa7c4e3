"""SLOW (~1.5 min on 2 idle cores, ~110 CPU-s): 17 real harness processes at once, 7 Claude Code
(Anthropic API), 6 mini-swe-agent (OpenAI chat completions) and 4 Codex CLI (OpenAI Responses API,
a short fixed instructions file), through one proxy and three builtin engines (scripted policy)
while 20 drains, each aborting calls in flight, move them between the engines. Six Claude Code
sessions run `--bare`; once done, three compact their conversations (`/compact`, a second process
continuing the session) while more drains abort the summary calls; the seventh does
its steps in a foreground sub-agent (the `Agent` tool, which `--bare` does not offer: its ~10K-token
prompts make it the slowest). Every harness exits 0 having done its whole task, and every agent's
records (main, sub-agent; a summary continuing the main agent) still form one token-for-token chain.

The sessions overlap by construction. All engines start drained, so each harness's first call
waits in the proxy (its bounded no-engine wait) until all 17 calls are waiting; then the engines
open and the drains begin. Each scripted step's tool asks for another step until the test marks
the drains over, so all 17 are still running at the last drain however fast the machine is.
Without the gate they would not overlap on 2 cores: a mini-swe-agent process costs ~10 CPU-s
(~8 of them importing litellm), a Claude Code one ~3, so Claude Code would be done before the
last mini-swe-agent sent its first call. (Codex is a native binary: ~1 CPU-s a process.)
"""

import json
import os
import resource
import subprocess
import time
from pathlib import Path

import pytest
from proxy_fixtures import http, new_execution, start_engine, start_proxy

from gyre.harness.agents import (
    find_claude_code,
    find_codex,
    find_mini_swe_agent,
    make_claude_code_command,
    make_claude_code_env,
    make_codex_command,
    make_codex_env,
    make_mini_swe_command,
    make_mini_swe_env,
)
from gyre.records.io import read_records
from gyre.records.record import MAIN_AGENT
from gyre.trajectory.tree import build_call_tree

pytestmark = pytest.mark.slow

NUM_CC, NUM_CC_SUB, NUM_MINI, NUM_CODEX, NUM_DRAINS = 6, 1, 6, 4, 20
NUM_COMPACTED, NUM_SUMMARY_DRAINS = 3, 2
"""Claude Code sessions compacted once done (cc0, cc1, ...), and the drains aimed at their summary calls."""
FILLER = "Checking the output; "
DONE_FILE = "drains-done"
"""Created next to the workspaces after the last drain; until then every step asks for another."""


def tool_call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def step(tool: str, marker: str, arg: str = "command") -> str:
    """A tool call printing MARKER-NEXT, or MARKER-LAST once the drains are over (and logging it)."""
    command = f"{{ test -e ../{DONE_FILE} && echo {marker}-LAST || echo {marker}-NEXT; }} | tee -a steps.txt"
    return FILLER + tool_call(tool, {arg: command})


SUMMARY = "<summary>" + "A helper printed the step markers until told to stop. " * 15 + "</summary>"
"""Long enough (~850 tokens) that drains find the summary calls mid-output."""
AGENT = tool_call(
    "Agent",
    {
        "description": "step helper",
        "prompt": "SUB-STEPS: print the step markers",
        "subagent_type": "general-purpose",
        "run_in_background": False,
    },
)

# The harnesses keep stepping while the drains go on, so all 17 run until the last one. The
# sub-agent session's main agent hands the steps to a helper and reports when it is back.
RULES = [
    {"match": "Do NOT call any tools", "emit": SUMMARY},
    {"match": "CC-TASK|CC-NEXT", "emit": step("Bash", "CC")},
    {"match": "CC-LAST", "emit": "All steps done. CC-COMPLETE"},
    {"match": "SUB-FINISHED", "emit": "All steps done. SUB-COMPLETE"},
    {"match": "SUB-LAST", "emit": "helper report: SUB-FINISHED"},
    {"match": "SUB-STEPS|SUB-NEXT", "emit": step("Bash", "SUB")},
    {"match": "SUB-TASK", "emit": FILLER + AGENT},
    {"match": "Please solve this issue|MINI-NEXT", "emit": step("bash", "MINI")},
    {
        "match": "MINI-LAST",
        "emit": "Done. " + tool_call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}),
    },
    {"match": "CODEX-TASK|CODEX-NEXT", "emit": step("exec_command", "CODEX", arg="cmd")},
    {"match": "CODEX-LAST", "emit": "All steps done. CODEX-COMPLETE"},
]
MARKERS = {"cc": "CC", "ccsub": "SUB", "mini": "MINI", "codex": "CODEX"}


def launch(tmp_path, proxy, name: str, key: str, compact: bool = False) -> subprocess.Popen:
    """One harness process in its own HOME and workspace; stdout to NAME.out, stderr to NAME.err.
    `compact`: Claude Code's `/compact` of the session the first process left (NAME-compact.*)."""
    home, ws = tmp_path / f"home-{name}", tmp_path / f"ws-{name}"
    home.mkdir(exist_ok=compact)
    ws.mkdir(exist_ok=compact)
    if name.startswith("cc"):
        sub = name.startswith("ccsub")
        prompt = "/compact" if compact else f"{MARKERS[name.rstrip('0123456789')]}-TASK: print the step markers"
        cmd = make_claude_code_command(
            find_claude_code(),
            prompt,
            model="tiny",
            tools=["Bash", "Agent"] if sub else ["Bash"],
            resume=compact,
            bare=not sub,
        )
        env = make_claude_code_env(dict(os.environ), proxy.url, key, str(home), "tiny")
        name += "-compact" if compact else ""
    elif name.startswith("codex"):
        (home / "instructions.md").write_text("You are a coding agent. Run shell commands with exec_command.\n")
        cmd = make_codex_command(
            find_codex(),
            "CODEX-TASK: print the step markers",
            proxy_url=proxy.url,
            model="gyre",
            instructions_file=str(home / "instructions.md"),
        )
        env = make_codex_env(dict(os.environ), key, str(home))
    else:
        cmd = make_mini_swe_command(
            find_mini_swe_agent(),
            "Print the step markers.",
            proxy_url=proxy.url,
            model="gyre",
            output=str(tmp_path / f"traj-{name}.json"),
        )
        env = make_mini_swe_env(os.environ | {"OPENAI_API_KEY": key}, str(home))  # the key: never argv
    with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
        return subprocess.Popen(cmd, env={**env, "OMP_NUM_THREADS": "1"}, cwd=ws, stdout=out, stderr=err)


def output_tail(tmp_path, name: str) -> str:
    return "".join((tmp_path / f"{name}.{s}").read_text()[-2000:] for s in ("out", "err"))


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds of a live process, or (pid None) of this process's reaped children so far."""
    if pid is None:
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def admin(proxy, path: str):
    status, out = http(
        proxy.url + path, "POST" if path.endswith(("drain", "activate")) else "GET", token=proxy.admin_token
    )
    assert status == 200, (path, out)
    return out


def wait_for_gate(proxy, procs: dict, tmp_path, timeout_s: float) -> None:
    """Until every harness has a call waiting in the proxy (no engine is active, so none finishes)."""
    deadline = time.monotonic() + timeout_s
    while admin(proxy, "/admin/metrics")["num_calls"] < len(procs):
        for name, p in procs.items():
            assert p.poll() is None, f"{name} exited early ({p.returncode}): {output_tail(tmp_path, name)}"
        assert time.monotonic() < deadline, f"not all harnesses called within {timeout_s} s"
        time.sleep(0.2)


def wait_for_first_answer(tmp_path, procs: dict, timeout_s: float) -> None:
    """Until some execution has a record: prompts are prefilled, so drains from now on also hit
    calls midway through their output (which then resume elsewhere with it)."""
    deadline = time.monotonic() + timeout_s
    files = [tmp_path / "records" / f"{name}.jsonl" for name in procs]
    while not any(f.exists() and f.stat().st_size for f in files):
        assert time.monotonic() < deadline, f"no call finished within {timeout_s} s"
        time.sleep(0.1)


def drain_repeatedly(
    proxy, engine_ids: list[str], procs: dict, num_drains: int, timeout_s: float
) -> tuple[list[tuple[str, int]], int]:
    """`num_drains` drains that each abort calls in flight, taking the engines in turn (an engine is
    drained once the proxy shows it streaming; a drain that found nothing left does not count),
    or fewer if every harness exits first.

    Returns:
        ((engine, calls it had in flight) per counted drain, harnesses still running at the last one)
    """
    hits, alive, turn = [], 0, 0
    deadline = time.monotonic() + timeout_s
    while len(hits) < num_drains and any(p.poll() is None for p in procs.values()):
        assert time.monotonic() < deadline, f"only {len(hits)} drains hit calls in flight within {timeout_s} s"
        busy = {e["engine_id"] for e in admin(proxy, "/admin/metrics")["engines"] if e["num_inflight"] > 0}
        eid = engine_ids[turn % len(engine_ids)]
        if eid not in busy:
            if busy:  # this engine is idle but another one streams: pass its turn
                turn += 1
            else:
                time.sleep(0.05)
            continue
        n = admin(proxy, f"/admin/engines/{eid}/drain")["result"]["num_aborted"]
        if n:
            hits.append((eid, n))
            alive = sum(p.poll() is None for p in procs.values())
            turn += 1
        time.sleep(0.2)
        admin(proxy, f"/admin/engines/{eid}/activate")
    return hits, alive


def test_20_drains_during_17_real_harness_sessions(tmp_path):
    if find_claude_code() is None or find_mini_swe_agent() is None or find_codex() is None:
        pytest.skip("Claude Code, mini-swe-agent or Codex not installed: run tools/setup.sh")
    engine_ids = ["e0", "e1", "e2"]
    engines = [start_engine(tmp_path, RULES, name=eid) for eid in engine_ids]  # from this thread (gyre.common.spawn)
    proxy = start_proxy(tmp_path, [e.url for e in engines], max_imbalance=2, no_engine_wait_s=400)
    procs: dict[str, subprocess.Popen] = {}
    compacting: dict[str, subprocess.Popen] = {}
    t0, children0 = time.monotonic(), cpu_s()
    try:
        for eid in engine_ids:  # the gate: calls wait until the engines open
            admin(proxy, f"/admin/engines/{eid}/drain")
        # mini-swe-agent first: its imports are the slow part
        names = (
            [f"mini{i}" for i in range(NUM_MINI)]
            + [f"cc{i}" for i in range(NUM_CC)]
            + [f"ccsub{i}" for i in range(NUM_CC_SUB)]
        )
        names += [f"codex{i}" for i in range(NUM_CODEX)]
        keys = {name: new_execution(proxy, name) for name in names}
        for name in names:
            procs[name] = launch(tmp_path, proxy, name, keys[name])
        wait_for_gate(proxy, procs, tmp_path, 400)
        for eid in engine_ids:
            admin(proxy, f"/admin/engines/{eid}/activate")
        wait_for_first_answer(tmp_path, procs, 400)
        hits, alive_at_last_drain = drain_repeatedly(proxy, engine_ids, procs, NUM_DRAINS, 400)
        (tmp_path / DONE_FILE).touch()
        for p in procs.values():
            p.wait(timeout=400)
        failed = {n: output_tail(tmp_path, n) for n, p in procs.items() if p.returncode != 0}
        assert not failed, failed
        compacting = {
            name: launch(tmp_path, proxy, name, keys[name], compact=True) for name in procs if is_compacted(name)
        }
        summary_hits, _ = drain_repeatedly(proxy, engine_ids, compacting, NUM_SUMMARY_DRAINS, 400)
        for p in compacting.values():
            p.wait(timeout=400)
        cpu = {
            "harnesses": cpu_s() - children0,
            "engines": sum(cpu_s(e.proc.pid) for e in engines),
            "proxy": cpu_s(proxy.proc.pid),
            "wall": time.monotonic() - t0,
        }
        metrics = admin(proxy, "/admin/metrics")
        failed = {n: output_tail(tmp_path, f"{n}-compact") for n, p in compacting.items() if p.returncode != 0}
        assert not failed, failed
    finally:
        for p in [*procs.values(), *compacting.values()]:
            if p.poll() is None:
                p.kill()
                p.wait()
        proxy.stop()
        for e in engines:
            e.stop()

    rerouted, num_records, with_output, summaries = {}, 0, 0, []
    for name in procs:
        nodes = check_clean_chains(tmp_path / "records" / f"{name}.jsonl")
        records = [n.record for n in nodes]
        kinds = [n.kind for n in nodes]
        if name.startswith("ccsub"):  # the main agent's two calls around its helper's
            stepping = [r for r in records if r.kind_hint == "subagent"]
            assert kinds == ["main", *["subagent"] * len(stepping), "main"], (name, kinds)
        elif is_compacted(name):  # the steps, then the summary
            stepping, summary = records[:-1], records[-1]
            assert kinds == ["main"] * len(stepping) + ["summary"], (name, kinds)
            summaries.append(summary)
        else:
            stepping = records
        check_task_done(tmp_path, name, len(stepping))
        rerouted[name], num_records = sum(r.rerouted for r in records), num_records + len(records)
        # a resume's prompt is input + output so far: more than the inputs alone = resumed mid-output
        with_output += sum(
            r.num_migrated_tokens + r.num_recomputed_tokens > (len(r.hints["engines"]) - 1) * r.input_ids.size
            for r in records
        )
    print(
        f"\n{NUM_DRAINS} drains found {sum(n for _, n in hits)} calls in flight ({hits}); {alive_at_last_drain} of "
        f"{len(procs)} harnesses alive at the last drain; {len(summary_hits)} drains during the compactions "
        f"({summary_hits}); {num_records} calls; rerouted records per execution "
        f"{rerouted}; {with_output} resumed mid-output; pool metrics "
        f"{ {k: v for k, v in metrics.items() if k != 'engines'} }; "
        f"seconds { {k: round(v, 1) for k, v in cpu.items()} }"
    )
    assert alive_at_last_drain == len(procs)  # all 20 drains happened while all 17 sessions ran
    assert len({eid for eid, _ in hits}) >= 2
    assert sum(rerouted.values()) > 0 and metrics["num_reroutes"] > 0 and metrics["kv_migrated_tokens"] > 0
    assert with_output > 0
    # the compactions are short: at least one drain must have caught a summary call in flight
    assert summary_hits and len(summaries) == NUM_COMPACTED and any(r.rerouted for r in summaries)
    assert metrics["num_calls"] == num_records  # every call recorded; no harness retried a call


def is_compacted(name: str) -> bool:
    """cc0 .. cc{NUM_COMPACTED-1} compact once done (the sub-agent session would cost ~1 min more)."""
    return name.startswith("cc") and not name.startswith("ccsub") and int(name[2:]) < NUM_COMPACTED


def check_task_done(tmp_path, name: str, num_calls: int) -> None:
    """The harness ran one tool per call but the last, in order, and ended its task the normal way."""
    marker = MARKERS[name.rstrip("0123456789")]
    steps = (tmp_path / f"ws-{name}" / "steps.txt").read_text()
    assert steps == f"{marker}-NEXT\n" * (num_calls - 2) + f"{marker}-LAST\n", (name, num_calls, steps)
    if name.startswith("cc"):
        result = json.loads((tmp_path / f"{name}.out").read_text())
        assert result["result"] == f"All steps done. {marker}-COMPLETE" and not result["is_error"], (name, result)
        if is_compacted(name):
            compacted = json.loads((tmp_path / f"{name}-compact.out").read_text())
            assert not compacted["is_error"], (name, compacted)
    elif name.startswith("codex"):
        events = [
            json.loads(line) for line in (tmp_path / f"{name}.out").read_text().splitlines() if line.startswith("{")
        ]
        said = [
            e["item"]["text"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"
        ]
        assert said[-1] == "All steps done. CODEX-COMPLETE" and events[-1]["type"] == "turn.completed", (
            name,
            events[-3:],
        )
    else:
        info = json.loads((tmp_path / f"traj-{name}.json").read_text())["info"]
        assert info["exit_status"] == "Submitted", (name, info)


def check_clean_chains(path) -> list:
    """Each agent's calls continue its previous one token for token (a summary continues a main
    call); a sub-agent's first call starts a branch spawned by the main agent. Returns the tree's nodes."""
    records, stats = read_records(path)
    assert stats.num_torn == 0 and not stats.invalid and len(records) >= 2, (path, len(records), stats)
    tree = build_call_tree(records)
    assert tree.missing_seqs == []
    last: dict[str, int] = {}
    for j, node in enumerate(tree.nodes):
        agent = node.record.agent_id
        if agent in last:
            prev = tree.nodes[node.parent] if node.parent is not None else None
            ok = node.parent == last[agent] or (node.kind == "summary" and prev is not None and prev.kind == "main")
            assert ok and node.shared >= prev.end, (
                f"{path.name}: call {j} ({node.kind}) does not extend call {last[agent]}"
            )
        elif j:
            assert node.parent is None and tree.nodes[node.spawned_by].record.agent_id == MAIN_AGENT, (
                f"{path.name}: call {j}"
            )
        assert node.record.hints["retokenized_turns"] == 0
        last[agent] = j
    return tree.nodes
