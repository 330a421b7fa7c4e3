"""Executions stopped at their time budget, through `gyre-train` on local cells (the seed's rule,
gyre.trajectory.rewards.settle_budget): one whose preserved workspace earns partial credit is
scored and trained with it; one without a valid reward (its workspace scores 0, or no model call
ended before the budget did) is discarded as budget_exhausted."""

import json
import sys
from pathlib import Path

import pytest
from test_coordinator import _finish, _gyre_train

from gyre.coordinator.ledger import read_ledger
from gyre.records.io import has_records, read_records

pytestmark = pytest.mark.slow

# A harness (harness=command) that works past its budget: it asks the model once (not when its
# task says hang), writes the reply to answer.txt when its task says partial, then waits to be stopped.
AGENT = """import pathlib, signal, sys, requests
instruction, url, key, model = sys.argv[1:5]
if "hang" not in instruction:
    body = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": instruction}]}
    r = requests.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer " + key}, timeout=600)
    r.raise_for_status()
    if "partial" in instruction:
        pathlib.Path("answer.txt").write_text(r.json()["choices"][0]["message"]["content"] or "-")
print("working past the budget", flush=True)
signal.pause()
"""
# Partial credit for an answer.txt, different per execution (a group with a spread trains); 0 without.
SCORE = """import hashlib, json, os, pathlib
name = os.path.basename(os.path.dirname(os.getcwd()))
credit = 0.01 + int(hashlib.sha256(name.encode()).hexdigest(), 16) % 97 / 100
print(json.dumps({"score": credit if pathlib.Path("answer.txt").exists() else 0}))
"""
BUDGET_S = 20
"""Each task's time budget: long past one short model call on a loaded box, so every execution but
the hanging ones has its call recorded when the budget stops it."""


def _taskset(tmp: Path) -> Path:
    (tmp / "score.py").write_text(SCORE)
    tasks = [
        {
            "task_id": f"t-{word}",
            "instruction": f"Task {word}: write a word to answer.txt.",
            "workspace": {"files": {"task.md": f"Task {word}.\n"}},
            "setup": None,
            "evaluator": {"kind": "json_score", "command": f"{{python}} {tmp / 'score.py'}", "timeout_s": 30},
            "time_budget_s": BUDGET_S,
        }
        for word in ("partial", "idle", "hang")
    ]
    (tmp / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return tmp / "tasks.jsonl"


def test_a_timed_out_execution_with_partial_credit_trains_and_one_without_is_budget_exhausted(tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    command = f"{sys.executable} {tmp_path / 'agent.py'} {{instruction}} {{proxy_url}} {{api_key}} {{model}}"
    run_dir = tmp_path / "run"
    summary = _finish(
        _gyre_train(run_dir, _taskset(tmp_path), "num_steps=1", "harness=command", f"harness.command='{command}'")
    )

    view = read_ledger(run_dir / "ledger.jsonl")
    by_task: dict[str, list[str]] = {}
    for eid, entries in view.history.items():
        by_task.setdefault(entries[0].task_id, []).append(eid)
    assert {t: len(e) for t, e in by_task.items()} == {"t-partial": 2, "t-idle": 2, "t-hang": 2}
    for eid in by_task["t-partial"]:  # stopped at the budget, its answer scored: trained with that score
        outcome = view.outcome(eid)
        assert outcome.state == "timed_out" and outcome.score > 0, outcome
        assert view.trained_step(eid) == 0
    for eid in by_task["t-idle"] + by_task["t-hang"]:  # no valid reward: discarded, not scored 0
        outcome = view.outcome(eid)
        assert (outcome.state, outcome.reason) == ("excluded", "budget_exhausted"), outcome
        assert view.trained_step(eid) is None
    # the idle ones acted (a call recorded: their workspace scored 0); the hanging ones never did
    assert all(len(read_records(run_dir / "records" / f"{e}.jsonl")[0]) == 1 for e in by_task["t-idle"])
    assert not any(has_records(run_dir / "records" / f"{e}.jsonl") for e in by_task["t-hang"])
    counts = summary["executions"]
    assert (counts["trained"], counts["excluded/budget_exhausted"], counts.get("timed_out")) == (2, 4, 2), counts
