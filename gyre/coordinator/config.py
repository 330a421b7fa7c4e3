"""The coordinator's own settings: batch shape, admission, micro-batching, checkpoints, local cells."""

import os
from dataclasses import dataclass, field, fields

from omegaconf import MISSING

from gyre.cells.config import ClusterConfig
from gyre.cells.serving import plan_cell
from gyre.engines.config import EngineConfig
from gyre.errors import require
from gyre.harness.config import HarnessConfig
from gyre.metrics.config import MetricsConfig
from gyre.models.config import ModelConfig
from gyre.proxy.config import ProxyConfig
from gyre.scheduler.config import SchedulerConfig
from gyre.tasks.config import TasksConfig
from gyre.train.config import TrainerConfig
from gyre.trajectory.config import TrajectoryConfig
from gyre.transfer.config import TransferConfig

ON_RESUME = ("continue", "rerun")
RUN_MODES = ("train", "replay", "rollout")
"""train: roll out and train (the product); replay: train from a records directory and its ledger,
no rollouts; rollout: roll out and evaluate, never train (weights stay at version 0)."""


@dataclass(kw_only=True)
class CoordinatorConfig:
    group_size: int = 8
    """G: executions of one task per group (GRPO normalises rewards within a group); >= 2. A group
    whose executions all score alike teaches nothing (excluded as `uniform_group`): with 8 that is
    about half as frequent as with 4 on the toy once its policy succeeds most of the time."""
    groups_per_step: int = 3
    """Groups that make one RL step's batch."""
    sessions_per_cell: int = 48
    """Executions one rollout cell serves at once; more wait in the queue (the waterlevel counts both)."""
    max_micro_batch_tokens: int = 8192
    """Tokens packed into one micro-batch (a longer path is an error naming this key)."""
    tick_s: float = 0.2
    """Seconds between two turns of the coordinator's loop."""
    start_budget_s: float = 1.0
    """Seconds a turn of the loop spends starting queued executions at most (a start, its proxy key,
    sandbox and harness, takes ~0.2 s on 2 cores); the rest start in the next turns. A step's burst
    of starts then never keeps the loop from collecting ended executions and handing training its
    next step: started whole, 64 of them idled the core ~13 s after each optimizer step."""
    checkpoint_every_steps: int = 1
    """Checkpoint the core after every this many optimizer steps (and at the end)."""
    on_resume: str = "continue"
    """What a resumed run does with an execution the restart interrupted: `continue` its harness
    session from its saved session, workspace and records (where its harness and task can: else
    it is re-run), or `rerun` it from the start as a new attempt."""
    max_continues: int = 3
    """An execution continued this many times is re-run instead."""
    cpus_per_cell: float = 0.5
    """Local cells: CPU quota of each cell's processes (cgroup), like a fixed number of GPUs."""
    cell_start_timeout_s: float = 300.0
    """How long the cell leaders may take to build their trainer and engine."""
    decode_window_s: float = 10.0
    """Trailing window, seconds, over which the proxy's per-engine counters give the decode speed,
    demand and capacity the policy sees (gyre.scheduler.decode)."""
    train_tok_s: float = 2000.0
    """Training throughput of one cell, tokens/s, the policy assumes until the first step measures it."""
    init_weights: str | None = None
    """Engine-format model directory the core starts from; None: the seeded init (tasks may warm-start)."""

    def __post_init__(self):
        require(self.group_size >= 2, "group_size", f"GRPO needs >= 2 executions per group, got {self.group_size}")
        require(self.groups_per_step >= 1, "groups_per_step", f"must be >= 1, got {self.groups_per_step}")
        require(self.sessions_per_cell >= 1, "sessions_per_cell", f"must be >= 1, got {self.sessions_per_cell}")
        require(
            self.max_micro_batch_tokens >= 16,
            "max_micro_batch_tokens",
            f"must be >= 16, got {self.max_micro_batch_tokens}",
        )
        require(self.tick_s > 0, "tick_s", f"must be > 0 s, got {self.tick_s}")
        require(self.start_budget_s > 0, "start_budget_s", f"must be > 0 s, got {self.start_budget_s}")
        require(
            self.checkpoint_every_steps >= 1,
            "checkpoint_every_steps",
            f"must be >= 1, got {self.checkpoint_every_steps}",
        )
        require(self.cpus_per_cell > 0, "cpus_per_cell", f"must be > 0, got {self.cpus_per_cell}")
        require(
            self.on_resume in ON_RESUME, "on_resume", f"must be one of {', '.join(ON_RESUME)}, got {self.on_resume!r}"
        )
        require(self.max_continues >= 0, "max_continues", f"must be >= 0, got {self.max_continues}")
        require(self.decode_window_s > 0, "decode_window_s", f"must be > 0 s, got {self.decode_window_s}")
        require(self.train_tok_s > 0, "train_tok_s", f"must be > 0, got {self.train_tok_s}")
        require(
            self.cell_start_timeout_s > 0, "cell_start_timeout_s", f"must be > 0 s, got {self.cell_start_timeout_s}"
        )


LOCAL_RESERVE_CPUS = 0.5
"""CPUs local cells leave to the processes outside them, which get only what the cells' caps leave."""


@dataclass(kw_only=True)
class GyreConfig:
    """Everything a Gyre run needs; each group owns its section."""

    cluster: ClusterConfig = MISSING
    engine: EngineConfig = MISSING
    model: ModelConfig = MISSING
    proxy: ProxyConfig = MISSING
    scheduler: SchedulerConfig = MISSING
    trainer: TrainerConfig = MISSING
    coordinator: CoordinatorConfig = MISSING
    trajectory: TrajectoryConfig = MISSING
    harness: HarnessConfig = MISSING
    tasks: TasksConfig = MISSING
    metrics: MetricsConfig = MISSING
    transfer: TransferConfig = field(default_factory=TransferConfig)
    """The site's fabric for Mooncake (no config group: `transfer.protocol=rdma transfer.device=mlx5_0`)."""
    seed: int = 0
    """Seed for every random generator of the run."""
    num_steps: int = 2
    """RL steps (optimizer steps on the core cell) to run."""

    mode: str = "train"
    """One of RUN_MODES (gyre.coordinator.config)."""
    resume: bool = False
    """Continue the run in this run directory (hydra.run.dir=...) from its latest checkpoint."""
    records: str | None = None
    """mode=replay: the records directory of an earlier run (its ledger.jsonl beside it gives the scores)."""

    def __post_init__(self):
        require(self.num_steps >= 1, "num_steps", f"must be >= 1, got {self.num_steps}")
        require(self.mode in RUN_MODES, "mode", f"must be one of {', '.join(RUN_MODES)}; got {self.mode!r}")
        require(
            self.mode != "replay" or bool(self.records),
            "records",
            "mode=replay needs records=DIR (an earlier run's records)",
        )
        if not all(isinstance(getattr(self, f.name), f.type) for f in fields(self) if f.type in _SECTIONS):
            return  # a section left unset (partial configs in tests); cross-section checks need all
        self._check_across()

    def site_env(self) -> dict[str, str]:
        """The variables every process of the run gets before it starts anything (Mooncake's fabric,
        MPI's libfabric provider): exported by gyre-train locally and by each Slurm task (gyre.launch.job)."""
        provider = self.cluster.mpi_provider
        return self.transfer.env() | ({"FI_PROVIDER": provider} if provider else {})

    def _check_across(self) -> None:
        """Checks that span sections, each naming the key to change."""
        if self.proxy.context_len == 0:
            self.proxy.context_len = self.model.max_seq_len
        require(
            self.proxy.context_len <= self.model.max_seq_len,
            "proxy.context_len",
            f"{self.proxy.context_len} exceeds the model's max_seq_len {self.model.max_seq_len}",
        )
        self._check_ranks()
        c, tp = self.cluster, self.trainer.tensor_parallel_size  # one rank per GPU, engines tiling the GPUs
        e = self.engine
        plan_cell(c.ranks_per_cell, c.cell_nodes, c.gpus_per_node, e.tp_size, e.on_gpu, tp, nnodes=e.nnodes)
        require(
            self.cluster.num_cells >= 2 or self.mode != "train" or self.scheduler.mode == "colocate",
            "cluster.num_cells",
            f"scheduler={self.scheduler.mode} trains on the core cell, which never serves: with 1 cell no engine "
            "would roll out (use >= 2 cells, or scheduler=colocate)",
        )
        for key, live, why in _SIM_ONLY:  # a key that validates but would do nothing live is refused
            value = getattr(self.scheduler, key)
            require(value == live, f"scheduler.{key}", f"{value!r} is modelled by gyre-sim only; a live run {why}")
        if self.cluster.backend == "local":  # the cells outweigh the rest (gyre.cells.quota), which needs room
            need, have = self.cluster.num_cells * self.coordinator.cpus_per_cell, len(os.sched_getaffinity(0))
            require(
                need + LOCAL_RESERVE_CPUS <= have,
                "cluster.num_cells",
                f"{self.cluster.num_cells} cells x coordinator.cpus_per_cell={self.coordinator.cpus_per_cell} "
                f"need {need:g} CPUs, and {LOCAL_RESERVE_CPUS:g} more stay for the harnesses, the proxy and "
                f"the coordinator; this machine has {have}",
            )

    def _check_ranks(self) -> None:
        """A cell of several ranks: every cell has the same layout, tensor parallel then data parallel."""
        ranks, tp = self.cluster.ranks_per_cell, self.trainer.tensor_parallel_size
        require(
            ranks % tp == 0,
            "trainer.tensor_parallel_size",
            f"{tp} does not divide cluster.ranks_per_cell={ranks} (the rest of the ranks are data parallel)",
        )


_SIM_ONLY = (
    ("microstep_tokens", 0, "splits micro-batches by coordinator.max_micro_batch_tokens: leave it 0"),
    ("admission", "step", "admits a step's executions once step k - staleness - 1 is applied: leave it 'step'"),
    ("batching", "fixed", "trains each step on its own groups: leave it 'fixed'"),
)
"""Scheduler switches the simulator models and the live coordinator does not (yet): (key, the
value a live run has, what it does instead)."""

_SECTIONS = (
    ClusterConfig,
    EngineConfig,
    ModelConfig,
    ProxyConfig,
    SchedulerConfig,
    TrainerConfig,
    CoordinatorConfig,
    TrajectoryConfig,
    HarnessConfig,
    TasksConfig,
    MetricsConfig,
    TransferConfig,
)
