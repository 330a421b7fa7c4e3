"""SLOW (under a minute): real Qwen Code (npm `@qwen-code/qwen-code`) through the proxy's chat
completions and a builtin engine running a scripted policy: a shell command, then the answer; its
records must hold the agent's chain. Skipped without the npm package
(tools/setup.sh installs it; or set GYRE_QWEN_CODE)."""

import dataclasses
import json
import os

import pytest
from proxy_fixtures import MODEL, new_execution, start_engine, start_proxy
from resume_fixtures import BLOCKING, kill_mid_command_and_resume, resumable_task, torn_transcript

from gyre.harness.agents import (
    CONTINUE_PROMPT,
    find_qwen_code,
    make_qwen_code_command,
    make_qwen_code_env,
    run_harness,
)
from gyre.harness.config import HarnessConfig
from gyre.models.tokenizer import ByteTokenizer
from gyre.records.io import read_records
from gyre.trajectory.tree import build_call_tree

pytestmark = pytest.mark.slow


def tool_call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


TOOLS = ["run_shell_command"]
"""The tests' one core tool (harness.qwen_code_tools): Qwen Code's prompt is then ~61k byte tokens
against ~76k with all its tools, and the tiny engine's quadratic prefill of it ~1.5x cheaper."""
SEQ = 65536

RULES = [  # first match wins, on the prompt text the model has not answered yet (gyre.engines.scripted)
    {"match": "Managed memory", "emit": "Nothing to remember."},
    {"match": "QWEN-STEP-DONE", "emit": "The marker is written. QWEN-COMPLETE"},
    {
        "match": "TASK-QWEN",
        "emit": "I will run it. " + tool_call("run_shell_command", {"command": "echo QWEN-STEP-DONE | tee step.txt"}),
    },
    {"match": ".", "emit": "Nothing to do."},
]


def test_qwen_code_runs_a_command_through_the_proxy(tmp_path):
    binary = find_qwen_code()
    if binary is None:
        pytest.skip("Qwen Code not installed: run tools/setup.sh (or set GYRE_QWEN_CODE)")
    engine = start_engine(tmp_path, RULES, model=dataclasses.replace(MODEL, max_seq_len=SEQ))
    proxy = start_proxy(tmp_path, [engine.url], context_len=SEQ)
    try:
        key = new_execution(proxy, "qw")
        for d in ("home", "ws"):
            (tmp_path / d).mkdir()
        env = make_qwen_code_env(dict(os.environ), proxy.url, key, str(tmp_path / "home"), "gyre")
        command = make_qwen_code_command(binary, "TASK-QWEN: write the marker", model="gyre", tools=TOOLS)
        done = run_harness(command, env, str(tmp_path / "ws"), 300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        result = json.loads(done.stdout)[-1]
        assert result["type"] == "result" and result["result"] == "The marker is written. QWEN-COMPLETE", result
        assert (tmp_path / "ws" / "step.txt").read_text() == "QWEN-STEP-DONE\n"  # the command really ran
    finally:
        proxy.stop()
        engine.stop()

    records, stats = read_records(tmp_path / "records" / "qw.jsonl")
    assert stats.num_torn == 0 and not stats.invalid
    tree = build_call_tree(records)
    # the agent's two calls (and the memory extractor's, when it ran before the exit); the call after
    # the tool result extends the first
    assert len(records) >= 2 and tree.missing_seqs == [], [r.hints for r in records]
    assert any(n.parent is not None and n.shared >= tree.nodes[n.parent].end for n in tree.nodes), tree.nodes


RESUME_RULES = [
    {"match": "Managed memory", "emit": "Nothing to remember."},
    {"match": CONTINUE_PROMPT, "emit": "The command was cut short; stopping here. QWEN-CONTINUED"},
    {"match": "TASK-QWEN", "emit": "I will run it. " + tool_call("run_shell_command", {"command": BLOCKING})},
    {"match": ".", "emit": "Nothing to do."},
]


def test_qwen_code_killed_mid_command_continues_its_session(tmp_path):
    """Qwen Code in its sandbox (`--session-id`), SIGKILLed while its command runs, continued by
    Sandbox.resume (`--resume`, the continue prompt): the resumed call carries the earlier turns
    verbatim, the interrupted command marked failed, then the continue prompt; the run ends."""
    if find_qwen_code() is None:
        pytest.skip("Qwen Code not installed: run tools/setup.sh (or set GYRE_QWEN_CODE)")
    engine = start_engine(tmp_path, RESUME_RULES, model=dataclasses.replace(MODEL, max_seq_len=SEQ))
    proxy = start_proxy(tmp_path, [engine.url], context_len=SEQ)
    # as its conf/harness (Node reserves address space), its shell its only core tool
    cfg = HarnessConfig(kind="qwen_code", mem_limit_gb=None, qwen_code_tools=TOOLS)

    try:
        task = resumable_task("TASK-QWEN: write the answer")
        _, _, result = kill_mid_command_and_resume(
            tmp_path, task, "qw-c", cfg, proxy, "gyre", torn_transcript("qwen_code", "qw-c"), 480
        )
    finally:
        proxy.stop()
        engine.stop()
    log = result.log_path.read_text()
    assert '"result":"The command was cut short; stopping here. QWEN-CONTINUED"' in log.replace(": ", ":")
    records = sorted(read_records(tmp_path / "records" / "qw-c.jsonl")[0], key=lambda r: r.seq)
    main = [r for r in records if "Managed memory" not in ByteTokenizer(512).decode(r.input_ids.tolist())]
    assert len(main) == 2, [r.hints for r in records]
    before, after = (ByteTokenizer(512).decode(r.input_ids.tolist()) for r in main)
    before += ByteTokenizer(512).decode(main[0].output_ids.tolist())
    # Qwen Code rebuilds its environment context (the folder listing, the date) when it resumes, so
    # the prefix matches up to the listing; from the task's turn on the earlier history is verbatim.
    turns = before[before.index("TASK-QWEN: write the answer<|im_end|>") :]
    assert turns in after and "sleep 30" in turns
    tail = after[after.index(turns) + len(turns) :]
    assert "<tool_response>" in tail and tail.endswith(f"{CONTINUE_PROMPT}<|im_end|>\n<|im_start|>assistant\n")
