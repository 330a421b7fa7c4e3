"""SLOW (about a minute, then ~30 s): real Claude Code 2.1.220 through the proxy and a builtin engine
running a scripted policy: a tool call, a foreground and a background sub-agent, then `/compact`; its
records must rebuild into the right call tree. Killed mid-command in its sandbox, it resumes its
session. Skipped without the npm package (tools/setup.sh installs it)."""

import json
import os

import pytest
from proxy_fixtures import new_execution, start_engine, start_proxy
from resume_fixtures import BLOCKING, kill_mid_command_and_resume, resumable_task, torn_transcript

from gyre.harness.agents import (
    CONTINUE_PROMPT,
    find_claude_code,
    harness_session_id,
    make_claude_code_command,
    make_claude_code_env,
    run_harness,
    session_transcript,
)
from gyre.harness.config import HarnessConfig
from gyre.models.tokenizer import ByteTokenizer
from gyre.records.io import read_records
from gyre.trajectory.tree import build_call_tree

pytestmark = pytest.mark.slow


def tool_call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def agent(description: str, prompt: str, background: bool) -> str:
    return tool_call(
        "Agent",
        {
            "description": description,
            "prompt": prompt,
            "subagent_type": "general-purpose",
            "run_in_background": background,
        },
    )


# First match wins, on the prompt text the model has not answered yet (gyre.engines.scripted).
RULES = [
    {
        "match": "Do NOT call any tools",
        "emit": "<analysis>short</analysis>\n<summary>Ran a command and two helpers.</summary>",
    },
    {
        "match": "TASK-ALPHA",
        "emit": "I will run a command. "
        + tool_call("Bash", {"command": "echo STEP1-DONE | tee step1.txt", "description": "write marker"}),
    },
    {"match": "SUBTASK-FG", "emit": tool_call("Bash", {"command": "echo FG-WORKED", "description": "print marker"})},
    {"match": "FG-WORKED", "emit": "fg report: FG-FINISHED"},
    {"match": "SUBTASK-BG", "emit": "bg report: BG-FINISHED"},
    {"match": "STEP1-DONE", "emit": agent("fg helper", "SUBTASK-FG: run the marker", False)},
    {"match": "FG-FINISHED", "emit": agent("bg helper", "SUBTASK-BG: report back", True)},
    {"match": "BG-FINISHED", "emit": "All helpers finished. ALPHA-COMPLETE"},
    {"match": ".", "emit": "Waiting for the background helper."},
]


def test_claude_code_tool_subagents_and_compact(tmp_path):
    binary = find_claude_code()
    if binary is None:
        pytest.skip("Claude Code not installed: run tools/setup.sh (or set GYRE_CLAUDE_CODE)")
    engine = start_engine(tmp_path, RULES)
    proxy = start_proxy(tmp_path, [engine.url])
    try:
        key = new_execution(proxy, "cc")
        (tmp_path / "home").mkdir()
        (tmp_path / "ws").mkdir()
        env = make_claude_code_env(dict(os.environ), proxy.url, key, str(tmp_path / "home"), "tiny")

        sid = harness_session_id("cc")  # the session id an execution starts and continues under

        def run(prompt, resume):
            tools = ["Bash", "Agent"]
            command = make_claude_code_command(binary, prompt, model="tiny", tools=tools, session_id=sid, resume=resume)
            return run_harness(command, env, str(tmp_path / "ws"), 300)

        first = run("TASK-ALPHA: run the marker and the helpers", False)
        assert first.returncode == 0, first.stdout + first.stderr
        assert json.loads(first.stdout)["result"] == "All helpers finished. ALPHA-COMPLETE"
        assert (tmp_path / "ws" / "step1.txt").read_text() == "STEP1-DONE\n"  # the tool really ran
        transcript = session_transcript("claude_code", tmp_path / "home", sid)
        assert transcript is not None  # where a continued execution finds it (gyre.harness.sandbox.continuable)
        second = run("/compact", True)  # --resume SID: the same session, as after a restart
        assert second.returncode == 0, second.stdout + second.stderr
    finally:
        proxy.stop()
        engine.stop()

    records, stats = read_records(tmp_path / "records" / "cc.jsonl")
    assert stats.num_torn == 0 and not stats.invalid
    tree = build_call_tree(records)
    assert tree.missing_seqs == []
    nodes = tree.nodes
    kinds = [n.kind for n in nodes]
    subagents = sorted({n.record.agent_id for n in nodes if n.kind == "subagent"})
    assert len(subagents) == 2, kinds  # foreground and background helper
    assert kinds.count("summary") == 1 and nodes[-1].kind == "summary"
    main = [i for i, n in enumerate(nodes) if n.kind == "main"]
    # The main agent's calls form one chain, each continuing the previous one token for token.
    for a, b in zip(main, main[1:]):
        assert nodes[b].parent == a and nodes[b].shared >= nodes[a].end, (a, b)
    # The summary request continues a main call (Claude Code resumes its saved transcript, which
    # may end before the answer to the last task notification).
    assert nodes[-1].parent in main and nodes[-1].shared >= nodes[nodes[-1].parent].end
    for agent_id in subagents:
        calls = [i for i, n in enumerate(nodes) if n.record.agent_id == agent_id]
        assert nodes[calls[0]].parent is None and nodes[calls[0]].spawned_by in main
        for a, b in zip(calls, calls[1:]):
            assert nodes[b].parent == a
    # The foreground helper made two calls (tool call, report), the background helper one.
    assert sorted(sum(n.record.agent_id == a for n in nodes) for a in subagents) == [1, 2]
    assert all(n.record.hints["retokenized_turns"] == 0 for n in nodes)


RESUME_RULES = [  # the command blocks until the test has killed the harness and flagged its return
    {"match": CONTINUE_PROMPT, "emit": "The command was cut short; stopping here. CC-CONTINUED"},
    {"match": "TASK-CC", "emit": "I will run it. " + tool_call("Bash", {"command": BLOCKING, "description": "answer"})},
    {"match": ".", "emit": "Nothing to do."},
]


def test_claude_code_killed_mid_command_resumes_its_session(tmp_path):
    """Claude Code in its sandbox (`--session-id`), SIGKILLed while its Bash command runs, continued
    by Sandbox.resume (`--resume`, the continue prompt, a torn last transcript line trimmed): the
    resumed call re-sends the interrupted call's prompt token for token (its answer too where the
    transcript holds it), then the continue prompt, and the run finishes."""
    if find_claude_code() is None:
        pytest.skip("Claude Code not installed: run tools/setup.sh (or set GYRE_CLAUDE_CODE)")
    engine = start_engine(tmp_path, RESUME_RULES)
    proxy = start_proxy(tmp_path, [engine.url])
    cfg = HarnessConfig(kind="claude_code", mem_limit_gb=None, claude_code_tools=["Bash"])  # as its conf/harness

    try:
        task = resumable_task("TASK-CC: write the answer")
        _, _, result = kill_mid_command_and_resume(
            tmp_path, task, "cc-c", cfg, proxy, "tiny", torn_transcript("claude_code", "cc-c")
        )
    finally:
        proxy.stop()
        engine.stop()
    log = result.log_path.read_text()
    assert (
        json.loads(log.strip().splitlines()[-1])["result"] == "The command was cut short; stopping here. CC-CONTINUED"
    )
    records, _ = read_records(tmp_path / "records" / "cc-c.jsonl")
    tree = build_call_tree(records)
    main = [i for i, n in enumerate(tree.nodes) if n.kind == "main"]
    assert len(main) == 2, [n.kind for n in tree.nodes]
    killed, resumed = (tree.nodes[i] for i in main)
    decode = ByteTokenizer(512).decode
    assert "sleep 30" in decode(killed.record.output_ids.tolist())  # the call the kill cut
    # The resumed call re-sends the history the transcript kept, token for token: the killed call's
    # prompt, then its answer where the transcript holds it, then the continue prompt. Claude Code
    # 2.1.220 had not written the answer when its command was killed (seen once: the transcript held
    # the task's turn only, and the resumed session put a synthetic "No response requested." there).
    prompt = killed.record.input_ids.tolist()
    assert resumed.record.input_ids[: len(prompt)].tolist() == prompt
    if resumed.parent == main[0]:
        assert resumed.shared >= killed.end
    assert CONTINUE_PROMPT in decode(resumed.record.input_ids[len(prompt) :].tolist())
