"""Configuration of where cells run: locally as process groups, or as one heterogeneous Slurm job."""

from dataclasses import dataclass, field

from gyre.errors import require

BACKENDS = ("local", "slurm")
"""local: cells are process groups on this machine; slurm: components of one heterogeneous Slurm job."""


@dataclass(kw_only=True)
class ClusterConfig:
    """How many cells of how many nodes, and what Slurm must grant them."""

    backend: str = "local"
    """Where cells run: one of BACKENDS."""
    num_cells: int = 2
    """Cells in the allocation, the core cell included (>= 1)."""
    cell_nodes: int = 1
    """Nodes per cell (48 on the reference cluster; 1 process group per cell locally)."""
    gpus_per_node: int = 0
    """GPUs each node contributes (0 = CPU only)."""
    cpus_per_node: int = 2
    """CPU cores requested per node."""
    mem_gb_per_node: int = 8
    """Memory requested per node, in GiB."""
    time_limit_min: int = 60
    """Wall-clock limit of the whole allocation, in minutes."""
    partition: str | None = None
    """Slurm partition (None = the cluster's default)."""
    account: str | None = None
    """Slurm account to charge (None = the user's default)."""
    sbatch_extra: list[str] = field(default_factory=list)
    """Extra `#SBATCH` options for every component, e.g. `--constraint=h200` (without `#SBATCH`)."""

    def __post_init__(self):
        require(self.backend in BACKENDS, "backend", f"must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        require(self.num_cells >= 1, "num_cells", f"must be >= 1 (the core cell), got {self.num_cells}")
        require(self.cell_nodes >= 1, "cell_nodes", f"must be >= 1 node per cell, got {self.cell_nodes}")
        require(self.gpus_per_node >= 0, "gpus_per_node", f"must be >= 0, got {self.gpus_per_node}")
        require(self.cpus_per_node >= 1, "cpus_per_node", f"must be >= 1, got {self.cpus_per_node}")
        require(self.mem_gb_per_node >= 1, "mem_gb_per_node", f"must be >= 1 GiB, got {self.mem_gb_per_node}")
        require(self.time_limit_min >= 1, "time_limit_min", f"must be >= 1 minute, got {self.time_limit_min}")

    @property
    def num_nodes(self) -> int:
        return self.num_cells * self.cell_nodes
