"""Configuration of the simulator: a workload profile, a cluster preset, and what to run and print.

Profiles and presets are Hydra groups (conf/profile, conf/preset); their YAML carries the
assumptions behind each number. Everything is checked in __post_init__ so a preset that cannot
run (more cells than nodes, zero capacity) fails at config time naming its key.
"""

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from gyre.errors import require
from gyre.scheduler.cells import Phase
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
    segments_samples: list[int] = field(default_factory=list)
    """Measured segments per execution (a live run's); non-empty = drawn from these (bootstrap,
    scaled by the task's difficulty draw) instead of the log-normal around `segments_median`."""
    gen_tokens_samples: list[float] = field(default_factory=list)
    """Measured tokens generated per segment; non-empty = drawn from these."""
    tool_s_samples: list[float] = field(default_factory=list)
    """Measured tool seconds per segment; non-empty = drawn from these."""
    start_s: float = 0.0
    """Coordinator seconds to start one execution (its sandbox and harness), one after another: a
    burst of n starts holds the live coordinator's loop n x start_s, during which it sees no
    execution end and hands training no new step (gyre.coordinator.rollouts.start_queued); 0 =
    instant."""
    start_budget_s: float = 0.0
    """The live coordinator.start_budget_s: a turn of its loop starts executions for at most this
    long, then collects and feeds training, so a burst holds those at most this long; 0 = the
    whole burst (runs from before the budget)."""

    def __post_init__(self):
        for key in ("groups_per_step", "group_size", "max_segments", "max_context_tokens"):
            require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        for key in ("segments_median", "gen_tokens_median", "tool_s_median", "context_tokens_per_segment"):
            require(getattr(self, key) > 0, key, f"must be > 0, got {getattr(self, key)}")
        for key in ("segments_sigma", "exec_sigma", "tool_s_sigma"):
            require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        require(self.train_token_factor > 0, "train_token_factor", f"must be > 0, got {self.train_token_factor}")
        require(self.start_s >= 0, "start_s", f"must be >= 0 s, got {self.start_s}")
        require(self.start_budget_s >= 0, "start_budget_s", f"must be >= 0 s, got {self.start_budget_s}")
        require(self.timeout_s > 0, "timeout_s", f"must be > 0 s, got {self.timeout_s}")
        require(
            0 <= self.excluded_fraction < 1, "excluded_fraction", f"must be in [0, 1), got {self.excluded_fraction}"
        )
        for key in ("segments_samples", "gen_tokens_samples", "tool_s_samples"):
            require(all(x >= 0 for x in getattr(self, key)), key, "samples must be >= 0")
        require(all(x >= 1 for x in self.segments_samples), "segments_samples", "samples must be >= 1")

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
    """Offload tier per node (HiCache host memory / Mooncake L3), tokens; 0 = no offload (evicted
    KV is recomputed)."""
    host_tier_scope: str = "cluster"
    """cluster: every node's host memory is pooled whatever its role; rollout_pool: only nodes of
    cells that start in rollout hold KV (what a user of fixed pools gets: training nodes' host
    memory is the trainer's)."""
    kv_load_tok_s_per_node: float = 2e6
    """Reload bandwidth from the offload tier to one node's GPUs, tokens/s."""
    max_sessions_per_node: int = 128
    """Engine batch limit: concurrent model calls per node even when KV is plentiful."""
    live_sessions_per_node: int = 0
    """Live executions a node serves at most, whatever its KV holds (a live coordinator's
    sessions_per_cell per node); 0 = bounded by the GPU KV alone."""
    gen_tok_s_per_node: float = 4000.0
    """Aggregate decode throughput of one node at full load, tokens/s (memory-bound: measured,
    not derived from FLOPs)."""
    session_tok_s: float = 60.0
    """Decode speed of one session on an unloaded engine, tokens/s."""
    # ---- compute: FLOPs x MFU (gyre.sim.cost) --------------------------------------------
    gpus_per_node: int = 8
    gpu_peak_tflops: float = 989.0
    """Dense bf16 peak of one GPU, TFLOP/s (H100/H200 SXM)."""
    active_params_b: float = 10.0
    """Active parameters per token, billions (MoE: the routed experts' share, not the total)."""
    attention_layers: int = 12
    """Layers with full (quadratic) attention; linear-attention layers are counted in the 6N term."""
    attention_dim: int = 8192
    """Query width of a full-attention layer (heads x head dim)."""
    train_mfu: float = 0.30
    """Fraction of peak training reaches at long context (25-35% is typical for MoE with context
    parallelism)."""
    prefill_mfu: float = 0.40
    """Fraction of peak the engines' prefill reaches."""
    logprob_recompute: bool = True
    """Recompute the behaviour policy's log-probs before training (one forward per token)."""
    reference_pass: bool = False
    """A reference-model forward per token (KL penalty)."""
    train_tok_s_per_node: float = 0.0
    """Training throughput per node, tokens/s; 0 = derived from FLOPs at the profile's context,
    > 0 = measured (it replaces the derivation)."""
    prefill_tok_s_per_node: float = 0.0
    """Prefill throughput per node, tokens/s; 0 = derived from FLOPs, > 0 = measured. Every new
    prompt token (tool output) is prefilled; a session whose KV was dropped recomputes it all."""
    optimizer_s: float = 5.0
    """The core's optimizer step, seconds."""
    weight_gb: float = 244.0
    """Bytes of weights published to the engines after each optimizer step, GB."""
    weight_sync_gb_s: float = 25.0
    """Effective bandwidth of publishing weights (broadcast over RDMA), GB/s."""
    optimizer_step_s: float = 0.0
    """Optimizer step plus weight sync, seconds; 0 = optimizer_s + weight_gb / weight_sync_gb_s,
    > 0 = measured."""
    cell_gen_tok_s: list[float] = field(default_factory=list)
    """Measured decode throughput of each cell, tokens/s (core first); empty = nodes x per node."""
    cell_train_tok_s: list[float] = field(default_factory=list)
    """Measured training throughput of each cell, tokens/s; empty = nodes x per node."""

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
        for key in (
            "kv_tokens_per_node",
            "max_sessions_per_node",
            "gen_tok_s_per_node",
            "session_tok_s",
            "kv_load_tok_s_per_node",
            "gpus_per_node",
            "gpu_peak_tflops",
            "active_params_b",
            "weight_sync_gb_s",
        ):
            require(getattr(self, key) > 0, key, f"must be > 0 (no capacity cannot run), got {getattr(self, key)}")
        for key in ("train_mfu", "prefill_mfu"):
            require(0 < getattr(self, key) <= 1, key, f"must be in (0, 1], got {getattr(self, key)}")
        for key in (
            "live_sessions_per_node",
            "host_kv_tokens_per_node",
            "train_tok_s_per_node",
            "prefill_tok_s_per_node",
            "optimizer_s",
            "weight_gb",
            "optimizer_step_s",
            "attention_layers",
            "attention_dim",
        ):
            require(getattr(self, key) >= 0, key, f"must be >= 0 (0 = derived or none), got {getattr(self, key)}")
        require(
            self.host_tier_scope in ("cluster", "rollout_pool"),
            "host_tier_scope",
            f"must be cluster or rollout_pool, got {self.host_tier_scope!r}",
        )
        for key in ("cell_gen_tok_s", "cell_train_tok_s"):
            values = getattr(self, key)
            require(
                not values or (len(values) == self.num_cells and min(values) > 0),
                key,
                f"must be empty or {self.num_cells} values > 0 (one per cell), got {values}",
            )

    @property
    def cell_nodes(self) -> int:
        return self.num_nodes // self.num_cells

    @property
    def decode_tok_s_per_node(self) -> float:
        """Decode throughput a node can reach: its aggregate, or its batch limit at session speed."""
        return min(self.gen_tok_s_per_node, self.max_sessions_per_node * self.session_tok_s)

    def sessions_per_node(self, mean_context_tokens: float) -> int:
        """Live sessions a node's own GPUs keep at `mean_context_tokens` (>= 1); sessions in tool
        calls hold no compute slot; at most `live_sessions_per_node` when set."""
        held = max(1, int(self.kv_tokens_per_node // max(1.0, mean_context_tokens)))
        return min(held, self.live_sessions_per_node) if self.live_sessions_per_node else held

    def serving_tok_s_per_node(self, mean_context_tokens: float) -> float:
        """Decode a node sustains at `mean_context_tokens`: its throughput, unless the contexts
        of the calls its GPU KV can hold at once, each at session speed, make less."""
        return min(self.decode_tok_s_per_node, self.sessions_per_node(mean_context_tokens) * self.session_tok_s)

    def pooled_sessions(self, mean_context_tokens: float, host_nodes: int | None = None) -> int:
        """Live sessions the offload tier keeps beyond the GPUs: every node's host memory pooled
        (or only `host_nodes` nodes' when the tier is scoped to the rollout pool)."""
        nodes = self.num_nodes if host_nodes is None else host_nodes
        return int(self.host_kv_tokens_per_node * nodes // max(1.0, mean_context_tokens))


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
    phase_s: dict[str, float] = field(default_factory=dict)
    """Measured seconds of switch phases by name (gyre.scheduler.cells.Phase values, e.g.
    pull_weights: 4.1), as a live run's cell leaders time them; a phase not named costs its share
    of the scheduler's rollout_to_train_s / train_to_rollout_s."""
    baselines: bool = False
    """Also run every baseline variant (async even / each pool size / tier per role, colocate at
    matched staleness and s=0) and print them against the tighter bound."""
    mechanisms: bool = False
    """Also run elastic with each policy mechanism alone (gyre.scheduler.config switches)."""

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
        phases = {p.value for p in Phase if p is not Phase.FINISH_MICROSTEP}
        for name, seconds in self.phase_s.items():
            require(name in phases, "phase_s", f"unknown phase {name!r}; valid: {', '.join(sorted(phases))}")
            require(seconds >= 0, "phase_s", f"{name} must be >= 0 s, got {seconds}")


ConfigStore.instance().store(name="sim_schema", node=SimConfig)
