"""Configuration of the simulator: a workload profile, a cluster preset, and what to run and print.

Profiles and presets are Hydra groups (conf/profile, conf/preset); their YAML carries the
assumptions behind each number. Everything is checked in __post_init__ so a preset that cannot
run (more cells than nodes, zero capacity) fails at config time naming its key.
"""

from dataclasses import dataclass, field

from omegaconf import MISSING

from gyre.errors import require
from gyre.scheduler.config import MODES, SchedulerConfig


@dataclass(kw_only=True)
class ProfileConfig:
    """A workload: groups of executions, each a sequence of (model call, tool call) segments.

    One simulated segment stands for several real calls (the seed reports hundreds per
    execution); durations and token counts are drawn log-normally from the medians and sigmas.
    """

    name: str = "custom"
    groups_per_step: int = 16
    """Groups (tasks) in one RL step's batch."""
    group_size: int = 8
    """Executions per group (G, for group-normalised advantages)."""
    segments_median: float = 20.0
    """Median number of segments per execution."""
    segments_sigma: float = 0.5
    """Log-normal sigma of a task's segments (shared by its group): the duration tail across tasks
    (the sensitivity table scales it)."""
    exec_sigma: float = 0.3
    """Log-normal sigma of segments between executions of one task (within a group)."""
    max_segments: int = 400
    """Cap on segments per execution."""
    gen_tokens_median: float = 1500.0
    """Median tokens generated per segment."""
    tool_s_median: float = 30.0
    """Median wall time of a segment's tool calls, seconds."""
    tool_s_sigma: float = 0.8
    """Log-normal sigma of tool time per segment."""
    context_tokens_per_segment: float = 8000.0
    """Context growth per segment (prompt, tool output and generated tokens), tokens."""
    max_context_tokens: int = 700_000
    """Context cap (the harness compacts beyond it); bounds training tokens per trajectory."""
    train_token_factor: float = 1.5
    """Trained tokens per final-context token (main + summaries + sub-agents, deduplicated)."""
    timeout_s: float = 3600.0
    """Per-execution time budget; a timed-out execution is scored on its workspace and trained."""
    excluded_fraction: float = 0.03
    """Executions that end without a valid reward and are excluded (never trained as zero)."""

    def __post_init__(self):
        for key in ("groups_per_step", "group_size", "max_segments", "max_context_tokens"):
            require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        for key in ("segments_median", "gen_tokens_median", "tool_s_median", "context_tokens_per_segment"):
            require(getattr(self, key) > 0, key, f"must be > 0, got {getattr(self, key)}")
        for key in ("segments_sigma", "exec_sigma", "tool_s_sigma"):
            require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        require(self.train_token_factor > 0, "train_token_factor", f"must be > 0, got {self.train_token_factor}")
        require(self.timeout_s > 0, "timeout_s", f"must be > 0 s, got {self.timeout_s}")
        require(
            0 <= self.excluded_fraction < 1, "excluded_fraction", f"must be in [0, 1), got {self.excluded_fraction}"
        )

    @property
    def executions_per_step(self) -> int:
        return self.groups_per_step * self.group_size


@dataclass(kw_only=True)
class PresetConfig:
    """A cluster: cells of nodes and what a node does per second for one model class."""

    name: str = "custom"
    num_nodes: int = 8
    """Nodes in the allocation."""
    num_cells: int = 2
    """Cells (the core included); num_nodes must split evenly into them."""
    kv_tokens_per_node: float = 16e6
    """GPU KV cache one node's engine holds, tokens: the contexts of sessions in a model call must
    fit, idle sessions stay cached there until evicted (LRU; see gyre.sim.kv)."""
    host_kv_tokens_per_node: float = 32e6
    """Offload tier per node (HiCache host memory / Mooncake L3, pooled across the cluster),
    tokens; 0 = no offload (evicted KV is recomputed)."""
    kv_load_tok_s_per_node: float = 2e6
    """Reload bandwidth from the offload tier to one node's GPUs, tokens/s."""
    max_sessions_per_node: int = 128
    """Engine batch limit: concurrent model calls per node even when KV is plentiful."""
    prefill_tok_s_per_node: float = 50000.0
    """Prefill throughput of one node, tokens/s: a session whose KV was evicted and not offloaded
    recomputes its whole context on its next model call."""
    gen_tok_s_per_node: float = 4000.0
    """Aggregate decode throughput of one node at full load, tokens/s."""
    session_tok_s: float = 60.0
    """Decode speed of one session on an unloaded engine, tokens/s."""
    train_tok_s_per_node: float = 20000.0
    """Training throughput (forward + backward) of one node, tokens/s."""
    optimizer_step_s: float = 30.0
    """Core's optimizer step plus publishing the new weight version, seconds."""

    def __post_init__(self):
        require(self.num_nodes >= 1, "num_nodes", f"must be >= 1, got {self.num_nodes}")
        require(self.num_cells >= 2, "num_cells", f"must be >= 2 (a core and a satellite), got {self.num_cells}")
        require(
            self.num_cells <= self.num_nodes,
            "num_cells",
            f"{self.num_cells} cells need at least as many nodes; num_nodes is {self.num_nodes}",
        )
        require(
            self.num_nodes % self.num_cells == 0,
            "num_cells",
            f"must divide num_nodes={self.num_nodes} into equal cells, got {self.num_cells}",
        )
        for key in ("kv_tokens_per_node", "max_sessions_per_node", "gen_tok_s_per_node", "session_tok_s",
                    "train_tok_s_per_node", "prefill_tok_s_per_node", "kv_load_tok_s_per_node"):
            require(getattr(self, key) > 0, key, f"must be > 0 (no capacity cannot run), got {getattr(self, key)}")
        require(self.host_kv_tokens_per_node >= 0, "host_kv_tokens_per_node",
                f"must be >= 0 (0 = no offload tier), got {self.host_kv_tokens_per_node}")
        require(self.optimizer_step_s >= 0, "optimizer_step_s", f"must be >= 0 s, got {self.optimizer_step_s}")

    @property
    def cell_nodes(self) -> int:
        return self.num_nodes // self.num_cells

    @property
    def decode_tok_s_per_node(self) -> float:
        """Decode throughput a node can reach: its aggregate, or its batch limit at session speed."""
        return min(self.gen_tok_s_per_node, self.max_sessions_per_node * self.session_tok_s)

    def sessions_per_node(self, mean_context_tokens: float) -> int:
        """Live sessions a node's own GPUs keep at `mean_context_tokens` (>= 1); sessions in tool
        calls hold no compute slot."""
        return max(1, int(self.kv_tokens_per_node // max(1.0, mean_context_tokens)))

    def serving_tok_s_per_node(self, mean_context_tokens: float) -> float:
        """Decode a node sustains at `mean_context_tokens`: its throughput, unless the contexts
        of the calls its GPU KV can hold at once, each at session speed, make less."""
        return min(self.decode_tok_s_per_node, self.sessions_per_node(mean_context_tokens) * self.session_tok_s)

    def pooled_sessions(self, mean_context_tokens: float) -> int:
        """Live sessions the cluster-wide offload tier keeps beyond the GPUs (every node's host
        memory is pooled, whatever the node's role)."""
        return int(self.host_kv_tokens_per_node * self.num_nodes // max(1.0, mean_context_tokens))


@dataclass(kw_only=True)
class SimConfig:
    """A gyre-sim run: which modes on which workload and cluster, and what to report."""

    profile: ProfileConfig = MISSING
    preset: PresetConfig = MISSING
    scheduler: SchedulerConfig = MISSING
    num_steps: int = 24
    """RL steps to simulate per mode."""
    seed: int = 0
    """Seed of the workload draw; every mode sees the same executions."""
    modes: list[str] = field(default_factory=lambda: list(MODES))
    """Modes to run (scheduler.mode is ignored here; every listed mode shares the rest)."""
    tick_s: float = 10.0
    """How often the policy is consulted between events, simulated seconds."""
    plot: str = "timeline.png"
    """PNG timeline path (relative to the run directory); empty = no plot."""
    lose_cell: int = 0
    """Index of a satellite that stops answering at `lose_at_h` in every mode (0 = none; the core
    cannot be lost here: its optimizer state restarts from a checkpoint, which is not simulated)."""
    lose_at_h: float = 1.0
    """When `lose_cell` is lost, simulated hours."""
    json: bool = False
    """Print one JSON object as the last line of output."""
    compare: bool = False
    """Also run the seed's four workloads and print the side-by-side table."""
    sensitivity: bool = False
    """Also print speedups as switch costs grow and as the duration tail thickens."""

    def __post_init__(self):
        require(self.num_steps >= 1, "num_steps", f"must be >= 1, got {self.num_steps}")
        require(self.tick_s > 0, "tick_s", f"must be > 0 s, got {self.tick_s}")
        require(len(self.modes) >= 1, "modes", "must list at least one mode")
        for m in self.modes:
            require(m in MODES, "modes", f"unknown mode {m!r}; valid: {', '.join(MODES)}")
        num_cells = self.preset.num_cells if isinstance(self.preset, PresetConfig) else None
        require(
            self.lose_cell >= 0 and (num_cells is None or self.lose_cell < num_cells),
            "lose_cell",
            f"must be 0 (none) or a satellite index 1..{(num_cells or 0) - 1}, got {self.lose_cell}",
        )
        require(self.lose_at_h >= 0, "lose_at_h", f"must be >= 0 h, got {self.lose_at_h}")

