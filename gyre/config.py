"""The root of Gyre's structured config: one typed field per Hydra group, registered in the ConfigStore.

Hydra composes `conf/` against these dataclasses, so unknown keys and wrong types fail at
composition. Value checks live in each component's `__post_init__`; `validate` runs them and
names the offending key with its full dotted path (e.g. `cluster.cell_nodes`). The library never
reads YAML itself: entry points receive a composed DictConfig and call `validate`. A run's output
directory is Hydra's (`hydra.run.dir`), not a Gyre key.
"""

import importlib.util
import os
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from gyre.cells.serving import plan_cell
from gyre.coordinator.config import RUN_MODES, CoordinatorConfig
from gyre.engines.config import EngineConfig
from gyre.errors import ConfigError, require
from gyre.harness.config import HarnessConfig
from gyre.launch.config import ClusterConfig
from gyre.metrics.config import MetricsConfig
from gyre.models.config import ModelConfig
from gyre.proxy.config import ProxyConfig
from gyre.scheduler.config import SchedulerConfig
from gyre.tasks.config import TasksConfig
from gyre.train.config import TrainerConfig
from gyre.trajectory.config import TrajectoryConfig
from gyre.transfer.config import TransferConfig

T = TypeVar("T")

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
        plan_cell(c.ranks_per_cell, c.cell_nodes, c.gpus_per_node, self.engine.tp_size, self.engine.on_gpu, tp)
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


def register_configs() -> None:
    """Register the root schema; its typed fields check every group's YAML merged into them."""
    ConfigStore.instance().store(name="gyre_schema", node=GyreConfig)


def validate(cfg: DictConfig, schema: type[T] = GyreConfig, runs_engines: bool = True) -> T:
    """Turn a composed config into typed objects of `schema` (GyreConfig, or gyre-sim's SimConfig),
    running every component's value checks; `runs_engines=False` (gyre-plan, which only plans them)
    skips the check that the engine asked for is installed here.

    Raises:
        ConfigError: naming the full dotted key of the first value that cannot run.
    """
    if schema is GyreConfig and runs_engines:
        _refuse_missing_sglang(cfg.engine)
    sections: dict[str, Any] = {}
    for f in fields(schema):
        node = cfg[f.name]
        try:
            sections[f.name] = OmegaConf.to_object(node) if OmegaConf.is_config(node) else node
        except ConfigError as e:
            raise e.under(f.name) from None
    return schema(**sections)


def _refuse_missing_sglang(engine: DictConfig) -> None:
    """A run must never serve with another engine than the one asked for: without sglang (and
    without its contract fake) `engine=sglang` stops here, before its own keys are checked."""
    if engine.backend != "sglang" or engine.get("sglang_fake", False):
        return
    if importlib.util.find_spec("sglang") is None:
        raise ConfigError(
            "engine.backend",
            "sglang is not installed here: `pip install 'gyre[sglang]'` on a CUDA node "
            "(or engine.sglang_fake=true for the CPU contract fake, tests only)",
        )
