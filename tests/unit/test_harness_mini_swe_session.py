"""mini-swe-agent's session agent (gyre/harness/mini_swe_session.py), in-process: it appends each
step to its session file, and a resumed agent sends the model the saved history and goes on with the
step loop, a torn last line trimmed. Mini's own model fake (DeterministicModel) and a shell fake."""

import json

import pytest

from gyre.harness.agents import read_mini_swe_session

pytest.importorskip("minisweagent")
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.test_models import DeterministicModel, make_output

from gyre.harness.mini_swe_session import MiniSessionAgent

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class Killed(BaseException):
    """Ends the agent mid-call as a SIGKILL would: no handler of mini's runs, no exit message."""


class TableShell(LocalEnvironment):
    """LocalEnvironment answering from a table, no process; its own check ends the run on a submit."""

    def __init__(self, outputs: dict[str, str]):
        super().__init__()
        self.outputs, self.ran = outputs, []

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict:
        self.ran.append(action["command"])
        output = {"output": self.outputs[action["command"]], "returncode": 0, "exception_info": ""}
        self._check_finished(output)
        return output


class RecordingModel(DeterministicModel):
    """DeterministicModel that keeps the messages each query was sent; past its outputs, a query
    raises Killed."""

    def __init__(self, outputs: list[dict]):
        super().__init__(outputs=outputs, cost_per_call=0.0)
        self.sent: list[list[dict]] = []

    def query(self, messages: list[dict], **kwargs) -> dict:
        self.sent.append([dict(m) for m in messages])
        if self.current_index + 1 == len(self.config.outputs):
            raise Killed
        return super().query(messages, **kwargs)


def make_agent(model, shell, session, resume=False) -> MiniSessionAgent:
    templates = {"system_template": "You are a shell agent.", "instance_template": "Task: {{task}}"}
    return MiniSessionAgent(
        model, shell, **templates, mode="yolo", confirm_exit=False, cost_limit=0, session_file=session, resume=resume
    )


def test_a_resumed_agent_sends_the_saved_history_and_finishes(tmp_path):
    session = tmp_path / "home" / "mini-session.jsonl"
    shell = TableShell({"echo one": "one\n", "echo two": "two\n", SUBMIT: "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n"})
    first = RecordingModel(
        [
            make_output("step one", [{"command": "echo one"}], cost=0.0),
            make_output("step two", [{"command": "echo two"}], cost=0.0),
        ]
    )
    with pytest.raises(Killed):
        make_agent(first, shell, session).run("count to two")
    lines = session.read_text().splitlines()
    assert len(lines) == 2 and [m["role"] for m in json.loads(lines[0])] == ["system", "user", "assistant", "user"]
    saved = read_mini_swe_session(session)
    assert len(saved) == 6 and saved[-1]["content"] == first.sent[-1][-1]["content"]
    with open(session, "a") as f:
        f.write('[{"role": "assistant", "cont')  # a step whose write the kill cut short

    second = RecordingModel([make_output("submit", [{"command": SUBMIT}], cost=0.0)])
    resumed = make_agent(second, shell, session, resume=True)
    result = resumed.run("count to two")
    assert result["exit_status"] == "Submitted" and shell.ran == ["echo one", "echo two", SUBMIT]
    # The continued call carries the history the interrupted call had (nothing added, no new turn).
    assert [m["content"] for m in second.sent[0]] == [m["content"] for m in first.sent[-1]]
    assert resumed.n_calls == 3  # the step limit counts the calls before the break
    assert read_mini_swe_session(session) == resumed.messages  # torn line gone, the new step appended
    assert resumed.messages[-1]["role"] == "exit"

    again = RecordingModel([])
    assert make_agent(again, shell, session, resume=True).run("count to two")["exit_status"] == "Submitted"
    assert again.sent == []  # a finished session is not run again


def test_an_agent_without_saved_steps_starts_the_task(tmp_path):
    session = tmp_path / "mini-session.jsonl"
    model = RecordingModel([make_output("submit", [{"command": SUBMIT}], cost=0.0)])
    shell = TableShell({SUBMIT: "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n"})
    assert make_agent(model, shell, session, resume=True).run("t")["exit_status"] == "Submitted"
    assert [m["content"] for m in model.sent[0]] == ["You are a shell agent.", "Task: t"]
