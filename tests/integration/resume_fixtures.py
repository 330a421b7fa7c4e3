"""Shared steps of the real-harness continuation tests: a harness in its sandbox is SIGKILLed while
its shell command blocks, then continued by `Sandbox.resume` as a restarted run would."""

import dataclasses
from collections.abc import Callable
from pathlib import Path

from proxy_fixtures import new_execution

from gyre.common.wait import wait_until
from gyre.harness.agents import harness_session_id, session_transcript
from gyre.harness.config import HarnessConfig
from gyre.harness.sandbox import Sandbox, SandboxResult
from gyre.tasks.spec import Task
from gyre.tasks.taskset import toy_taskset

BLOCKING = "test -e resumed.flag || { touch started.flag; sleep 30; }; echo ANSWER-WRITTEN | tee answer.txt"
"""The command a scripted policy has the harness run: it blocks until the test has killed the
harness (started.flag says it runs) and flagged its return (resumed.flag)."""


def resumable_task(instruction: str) -> Task:
    """A toy task with the given instruction and a budget the kill and the resume fit in."""
    return dataclasses.replace(toy_taskset().get("word-apple"), instruction=instruction, time_budget_s=300)


def kill_mid_command_and_resume(
    tmp_path: Path,
    task: Task,
    execution_id: str,
    cfg: HarnessConfig,
    proxy,
    model: str,
    tear: Callable[[Sandbox], None],
    start_timeout_s: float = 240,
) -> tuple[Sandbox, Sandbox, SandboxResult]:
    """Run `task` in a sandbox until its command runs (BLOCKING), SIGKILL it, let `tear(first)`
    check and tear its session file as a kill mid-write would, and continue the execution to
    its end. Returns (the killed sandbox, the continued one, the continued run's result)."""
    key = new_execution(proxy, execution_id)
    first = Sandbox(task, execution_id, tmp_path / "sandboxes", cfg, proxy.url, key, model)
    first.prepare()
    first.start()
    wait_until(lambda: (first.workspace / "started.flag").exists() or first.poll() is not None, start_timeout_s)
    assert (first.workspace / "started.flag").exists(), first.log_path.read_text()[-3000:]
    first.kill()
    tear(first)
    (first.workspace / "resumed.flag").touch()
    again = Sandbox(task, execution_id, tmp_path / "sandboxes", cfg, proxy.url, key, model)
    again.resume(used_s=first.poll().duration_s)
    again.start()
    result = again.wait()
    assert result.exit_code == 0, result.log_path.read_text()[-3000:]
    return first, again, result


def torn_transcript(kind: str, execution_id: str) -> Callable[[Sandbox], None]:
    """The tear for Claude Code's or Qwen Code's session transcript: a last line the kill cut short."""

    def tear(first: Sandbox) -> None:
        transcript = session_transcript(kind, first.home, harness_session_id(execution_id))
        assert transcript is not None, sorted(p.name for p in first.home.rglob("*"))
        with open(transcript, "a") as f:
            f.write('{"type": "assistant", "mess')

    return tear
