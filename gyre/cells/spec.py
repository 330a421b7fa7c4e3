"""What a cell leader process needs to start: its sections of the run's config, serialised."""

import dataclasses
from dataclasses import dataclass

from gyre.common import jsonio
from gyre.engines.config import EngineConfig
from gyre.models.config import ModelConfig
from gyre.train.config import TrainerConfig


@dataclass(frozen=True, kw_only=True)
class CellSpec:
    index: int
    """Scheduler cell index; 0 is the core."""
    role: str
    """Initial role (gyre.scheduler.cells.Role value)."""
    model: ModelConfig
    trainer: TrainerConfig
    engine: EngineConfig
    seed: int
    ranks: int = 1
    """Processes of the cell's trainer (cluster.ranks_per_cell); the leader is rank 0."""
    nodes: int = 1
    """Nodes of the cell (cluster.cell_nodes; locally emulated): one engine each on CPU (gyre.cells.serving)."""
    followers_placed: bool = False
    """Ranks 1.. were started by the cluster (Slurm: tasks of the cell's component, which join the
    group themselves: gyre.cells.slurm); False: the leader spawns them (gyre.train.ranks)."""
    host: str
    """Interface its servers bind (the core's satellite listener, Mooncake)."""
    coordinator_address: str
    """The coordinator's cell listener (gyre.control.transport address)."""
    control: str = "tcp"
    """Control transport (cluster.control): under mpi the core's satellite listener is MPI too."""
    control_peer_timeout_s: float = 30.0
    """MPI only: silence after which a peer is presumed dead (cluster.control_peer_timeout_s)."""
    proxy_url: str
    proxy_admin_token: str
    checkpoint_dir: str
    run_dir: str
    """Where the cell's events go (the run's events.jsonl)."""
    init_weights: str | None = None
    """Engine-format model directory the core starts from (None: the seeded init)."""
    resume: bool = False
    """The core restores the latest checkpoint under checkpoint_dir."""

    def to_json(self) -> str:
        return jsonio.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "CellSpec":
        raw = jsonio.loads(text)
        sections = {"model": ModelConfig, "trainer": TrainerConfig, "engine": EngineConfig}
        return cls(**{k: sections[k](**v) if k in sections else v for k, v in raw.items()})
