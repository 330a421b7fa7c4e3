"""Harness config (Hydra group `harness`): which agent program runs in each sandbox, and its limits."""

from dataclasses import dataclass, field

from gyre.errors import ConfigError, require

KINDS = ("toy", "claude_code", "mini_swe_agent", "codex", "qwen_code", "command")
ISOLATIONS = ("auto", "bwrap", "podman", "none")
PLACEHOLDERS = ("instruction", "workspace", "proxy_url", "api_key", "model")


@dataclass(kw_only=True)
class ToyAgentConfig:
    """The toy agent's behaviour (`python -m gyre.harness.toy_agent`)."""

    api: str = "openai"
    """`openai` (chat completions, sub-agents hinted) or `anthropic` (Messages API: sub-agents and
    summaries hinted); the agent speaks either over plain HTTP, at the same start-up cost."""
    max_tokens: int = 96
    """New tokens per model call."""
    max_turns: int = 4
    """Main-agent model calls (summaries aside)."""
    subagent: bool = True
    """Spawn one sub-agent that surveys the workspace before the main agent starts."""
    verify: bool = True
    """Once the main agent is done, spawn a sub-agent with the survey's prompt that lists the
    workspace again. The toy's path cap (3 of its 4 paths) then drops the survey's path, the later
    one of its class, and this one trains the same prompt: with one sub-agent under a cap of 2 the
    survey was never trained, drifted with the weights it shares, and broke every execution at once."""
    subagent_turns: int = 2
    clear_chars: int = 100
    """Replace every tool result but the latest turn's with a placeholder once the conversation
    passes this many characters (the next call branches off the first call that saw them)."""
    compact_chars: int = 300
    """Compact (summary request, fresh conversation) once the conversation passes this many characters."""
    tool_median_s: float = 0.05
    """Median tool-call duration; durations are log-normal: median * exp(sigma * N(0, 1))."""
    tool_sigma: float = 2.5
    """Log-normal shape: 2.5 puts p90 at ~25x and p99 at ~330x the median (the long tail: ~2 % of
    toy executions outlast their 30 s budget on an idle box)."""
    tool_max_s: float = 60.0
    seed: int = 0
    """Tool durations are seeded by this and the execution id."""

    def __post_init__(self):
        require(self.api in ("anthropic", "openai"), "api", f"{self.api!r} is not one of anthropic, openai")
        require(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        require(self.max_turns >= 1, "max_turns", "must be >= 1")
        require(self.subagent_turns >= 1, "subagent_turns", "must be >= 1")
        require(self.clear_chars >= 1, "clear_chars", "must be >= 1 character")
        require(self.compact_chars >= 1, "compact_chars", "must be >= 1 character")
        require(self.tool_median_s >= 0, "tool_median_s", "must be >= 0 s")
        require(self.tool_sigma >= 0, "tool_sigma", "must be >= 0")
        require(self.tool_max_s >= self.tool_median_s, "tool_max_s", "must be >= tool_median_s")


@dataclass(kw_only=True)
class HarnessConfig:
    """One sandboxed agent program per execution (see gyre/harness/sandbox.py)."""

    kind: str = "toy"
    """toy | claude_code | mini_swe_agent | codex | qwen_code | command."""
    command: str = ""
    """kind=command: a command line (split like a shell would, then each word formatted) with the
    placeholders {instruction} {workspace} {proxy_url} {api_key} {model}; write {{ }} for braces."""
    isolation: str = "auto"
    """bwrap: bubblewrap (workspace and a private HOME writable, the rest read-only; fails if it
    cannot run); none: the plain runner; auto: bwrap where it runs, else a warning and none;
    podman: as bwrap, but a Harbor task that needs an image runs in it (gyre/harness/podman.py)."""
    grace_s: float = 5.0
    """Seconds between SIGTERM at the time budget and SIGKILL of the whole process group."""
    cpu_limit_s: int | None = 3600
    """RLIMIT_CPU per process (CPU seconds); None: unlimited."""
    mem_limit_gb: float | None = 4.0
    """RLIMIT_AS per process (virtual memory); None: unlimited (Node reserves large address spaces)."""
    max_processes: int | None = 4096
    """RLIMIT_NPROC (processes of the user; not enforced for root); None: unlimited."""
    agent_network: str = "public"
    """Site policy for the agent's network in a Harbor task's environment: public (Harbor's default,
    where the task asks for no less) or none (no agent gets one; a task whose task.toml asks for a
    public network is refused naming the field). The proxy is reached either way (podman: the relay)."""
    image_registries: list[str] = field(default_factory=lambda: ["docker.io"])
    """Registries a short image name (`alexgshaw/fix-git:x`, `python:3.12`) is pulled from, tried in order."""
    container_image: str | None = None
    """Run each sandbox in this Apptainer/enroot image (Slurm sites); None: on the host."""
    container_runtime: str = "apptainer"
    """apptainer | enroot."""
    claude_code_tools: list[str] = field(default_factory=lambda: ["Bash", "Read", "Write", "Edit", "Agent"])
    qwen_code_tools: list[str] | None = None
    """kind=qwen_code: its core tools (`--core-tools`, e.g. [run_shell_command, read_file, write_file,
    edit]); None: all of Qwen Code's. Qwen Code 0.24's prompt is ~76k characters with all of them and
    ~61k with [run_shell_command] (its agent, skill and other built-ins stay)."""
    toy: ToyAgentConfig = field(default_factory=ToyAgentConfig)

    def __post_init__(self):
        require(self.kind in KINDS, "kind", f"{self.kind!r} is not one of {', '.join(KINDS)}")
        require(self.isolation in ISOLATIONS, "isolation", f"{self.isolation!r} is not one of {', '.join(ISOLATIONS)}")
        require(self.kind != "command" or bool(self.command.strip()), "command", "kind=command needs a command line")
        if self.kind == "command":
            try:
                self.command.format(**{p: "" for p in PLACEHOLDERS})
            except (KeyError, IndexError, ValueError) as e:
                raise ConfigError(
                    "command", f"bad placeholder {e}; valid: {', '.join('{' + p + '}' for p in PLACEHOLDERS)}"
                ) from None
        require(
            self.container_runtime in ("apptainer", "enroot"),
            "container_runtime",
            f"{self.container_runtime!r} is not one of apptainer, enroot",
        )
        require(
            self.agent_network in ("public", "none"),
            "agent_network",
            f"{self.agent_network!r} is not one of public, none",
        )
        require(bool(self.image_registries), "image_registries", "must name at least one registry")
        require(self.grace_s >= 0, "grace_s", "must be >= 0 s")
        require(self.cpu_limit_s is None or self.cpu_limit_s >= 1, "cpu_limit_s", "must be >= 1 s or null")
        require(self.mem_limit_gb is None or self.mem_limit_gb > 0, "mem_limit_gb", "must be > 0 GB or null")
        require(self.max_processes is None or self.max_processes >= 1, "max_processes", "must be >= 1 or null")
        if isinstance(self.toy, dict):
            try:
                self.toy = ToyAgentConfig(**self.toy)
            except ConfigError as e:
                raise e.under("toy") from None
