"""mini-swe-agent's agent class for Gyre (`mini --agent-class gyre.harness.mini_swe_session.MiniSessionAgent`):
mini's own agent (InteractiveAgent) that appends each step's messages to a session file in the
execution's HOME and, told to resume, reloads them and goes on with the step loop, so an execution a
restart interrupted continues where its last whole step ended (gyre.harness.sandbox.continuable).

Imported only in mini-swe-agent's process: it imports minisweagent (the optional `harness` extra).
A continued run needs no extra user turn: the saved messages end with the last step's observation,
which the model answers next, exactly as it would have without the break.
"""

from pathlib import Path

from minisweagent.agents.interactive import InteractiveAgent, InteractiveAgentConfig

from gyre.harness.agents import append_mini_swe_step, read_mini_swe_session


class MiniSessionConfig(InteractiveAgentConfig):
    session_file: Path
    """Where the session's steps are appended (one line per step)."""
    resume: bool = False
    """Continue the saved session instead of starting one (set when the execution continues)."""


class MiniSessionAgent(InteractiveAgent):
    """InteractiveAgent whose session outlives its process (see the module's docstring)."""

    def __init__(self, *args, config_class: type = MiniSessionConfig, **kwargs):
        super().__init__(*args, config_class=config_class, **kwargs)
        self._num_saved = 0
        """How many of `messages` the session file holds."""
        self._restore: list[dict] | None = None

    def run(self, task: str = "", **kwargs) -> dict:
        """The step loop, from the saved session's end when resuming (from the start if it saved none)."""
        path = self.config.session_file
        saved = read_mini_swe_session(path) if self.config.resume and path.is_file() else []
        if saved and saved[-1].get("role") == "exit":  # it had finished; only its exit went unreported
            self.messages, self._num_saved = saved, len(saved)
            return saved[-1].get("extra", {})
        self._restore = saved or None
        return super().run(task, **kwargs)

    def add_messages(self, *messages: dict) -> list[dict]:
        # DefaultAgent.run opens with the system and task messages: a resumed run's saved ones take their place.
        if self._restore is not None:
            messages, self._restore = tuple(self._restore), None
            self._num_saved = len(messages)
            self.n_calls = sum(m.get("role") == "assistant" for m in messages)  # its step limit counts them
        return super().add_messages(*messages)

    def save(self, path: Path | None, *extra_dicts) -> dict:
        """After each step (DefaultAgent.run saves then): its messages appended to the session file."""
        if len(self.messages) > self._num_saved:
            self.config.session_file.parent.mkdir(parents=True, exist_ok=True)
            append_mini_swe_step(self.config.session_file, self.messages[self._num_saved :])
            self._num_saved = len(self.messages)
        return super().save(path, *extra_dicts)
