"""Configuration of where cells run: locally as process groups, or as one heterogeneous Slurm job."""

from dataclasses import dataclass, field

from gyre.errors import require

BACKENDS = ("local", "slurm")
CONTROLS = ("tcp", "mpi")
"""local: cells are process groups on this machine; slurm: components of one heterogeneous Slurm job."""


@dataclass(kw_only=True)
class ClusterConfig:
    """How many cells of how many nodes, and what Slurm must grant them."""

    backend: str = "local"
    """Where cells run: one of BACKENDS."""
    num_cells: int = 2
    """Cells in the allocation, the core cell included (>= 1); derived when allocation_nodes is set."""
    cell_nodes: int = 1
    """Nodes per cell (48 on the reference cluster; 1 process group per cell locally)."""
    ranks_per_cell: int = 1
    """Processes of each cell's trainer, one torch.distributed group (gloo on CPU) laid out by
    trainer.tensor_parallel_size (the rest data parallel), the same in every cell: satellite rank r
    pulls from and writes to core rank r. backend=local: set it; backend=slurm: derived, cell_nodes x
    ranks_per_node (one Slurm task per rank), where > 1 is built for a core that trains alone
    (num_cells=1: mode=replay or scheduler=colocate) and satellites of several ranks are refused."""
    ranks_per_node: int | None = None
    """backend=slurm: trainer ranks (Slurm tasks) on each node of a cell; the first task of a cell is
    its leader (rank 0), the others follow it. None: one per GPU (gpus_per_node), or 1 on a CPU
    cluster; on a GPU cluster any other value is refused (idle GPUs, or two ranks on one:
    gyre.cells.serving.plan_cell). backend=local: 1."""
    allocation_nodes: int | None = None
    """Nodes of all cells together, when sized that way: num_cells = allocation_nodes / cell_nodes
    (which must divide it). None: num_cells decides."""
    gpus_per_node: int = 0
    """GPUs each node contributes (0 = CPU only)."""
    gpu_mem_gb: float = 80.0
    """Memory of one GPU, in GB (1e9 bytes): the capacity `gyre-plan` and gyre-train's start check
    fit each GPU's trainer and engine into (gyre.launch.memory)."""
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
    coordinator_cpus: int = 4
    """Slurm: CPU cores of the coordinator's component (coordinator, proxy, harness sandboxes)."""
    coordinator_mem_gb: int = 16
    """Slurm: memory of the coordinator's component, in GiB."""
    control: str | None = None
    """Transport of the control messages (coordinator <-> cell leaders, core <-> satellites): one of
    CONTROLS. mpi: mpi4py + MPICH (ch4:ofi over TCP), each leader under `mpiexec -n 1`, joined by
    port files in the run directory (gyre/control/mpi.py). None: mpi on Slurm (the design's control
    plane), tcp locally (no MPI launcher needed, a dead peer seen at once)."""
    mpi_provider: str | None = None
    """control=mpi: the libfabric provider MPICH's ch4:ofi uses (FI_PROVIDER: `tcp`, `verbs;ofi_rxm`,
    `efa`, `cxi`, ...), exported to every process of the run. None: the environment's FI_PROVIDER,
    else tcp (gyre/control/mpi.py)."""
    control_peer_timeout_s: float = 30.0
    """mpi: silence after which a peer is declared dead (MPICH reports no dead peer; heartbeats
    every 0.5 s). Long enough for a leader busy in a loaded step; a dead cell is found this late."""
    bind_host: str | None = None
    """Address the coordinator's listener and proxy, and each cell's servers, bind and advertise.
    None: 127.0.0.1 locally; on Slurm each process's own node (SLURMD_NODENAME, resolved), so
    peers on other nodes reach it. A literal address fits only runs whose processes share a host."""

    def __post_init__(self):
        require(self.backend in BACKENDS, "backend", f"must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        require(self.num_cells >= 1, "num_cells", f"must be >= 1 (the core cell), got {self.num_cells}")
        require(self.cell_nodes >= 1, "cell_nodes", f"must be >= 1 node per cell, got {self.cell_nodes}")
        if self.allocation_nodes is not None:
            require(
                self.allocation_nodes % self.cell_nodes == 0,
                "cell_nodes",
                f"cells of {self.cell_nodes} nodes do not divide allocation_nodes={self.allocation_nodes}; "
                f"pick a divisor of {self.allocation_nodes}",
            )
            self.num_cells = self.allocation_nodes // self.cell_nodes
            require(self.num_cells >= 1, "allocation_nodes", f"must hold >= 1 cell, got {self.allocation_nodes} nodes")
        require(self.ranks_per_cell >= 1, "ranks_per_cell", f"must be >= 1, got {self.ranks_per_cell}")
        require(self.gpus_per_node >= 0, "gpus_per_node", f"must be >= 0, got {self.gpus_per_node}")
        if self.ranks_per_node is None:
            self.ranks_per_node = self.gpus_per_node if self.backend == "slurm" and self.gpus_per_node else 1
        require(self.ranks_per_node >= 1, "ranks_per_node", f"must be >= 1, got {self.ranks_per_node}")
        if self.backend == "slurm":
            ranks = self.cell_nodes * self.ranks_per_node
            require(
                self.ranks_per_cell in (1, ranks),
                "ranks_per_cell",
                f"on Slurm a cell's ranks are cell_nodes x ranks_per_node = {ranks}; leave ranks_per_cell unset "
                f"(got {self.ranks_per_cell})",
            )
            self.ranks_per_cell = ranks
        else:
            require(
                self.ranks_per_node == 1,
                "ranks_per_node",
                f"backend=local places no nodes: set cluster.ranks_per_cell instead (got {self.ranks_per_node})",
            )
        require(self.gpu_mem_gb > 0, "gpu_mem_gb", f"must be > 0 GB, got {self.gpu_mem_gb}")
        require(self.cpus_per_node >= 1, "cpus_per_node", f"must be >= 1, got {self.cpus_per_node}")
        require(self.mem_gb_per_node >= 1, "mem_gb_per_node", f"must be >= 1 GiB, got {self.mem_gb_per_node}")
        require(self.time_limit_min >= 1, "time_limit_min", f"must be >= 1 minute, got {self.time_limit_min}")
        if self.control is None:
            self.control = "mpi" if self.backend == "slurm" else "tcp"
        require(self.control in CONTROLS, "control", f"must be one of {', '.join(CONTROLS)}; got {self.control!r}")
        require(
            self.mpi_provider is None or bool(self.mpi_provider.strip()) and " " not in self.mpi_provider,
            "mpi_provider",
            f"must be a libfabric provider name (FI_PROVIDER, e.g. tcp, verbs;ofi_rxm, efa), got {self.mpi_provider!r}",
        )
        require(
            self.control_peer_timeout_s > 0,
            "control_peer_timeout_s",
            f"must be > 0 s, got {self.control_peer_timeout_s}",
        )
        require(self.coordinator_cpus >= 1, "coordinator_cpus", f"must be >= 1, got {self.coordinator_cpus}")
        require(self.coordinator_mem_gb >= 1, "coordinator_mem_gb", f"must be >= 1 GiB, got {self.coordinator_mem_gb}")

    @property
    def num_nodes(self) -> int:
        """Nodes of all cells (the coordinator's node not included)."""
        return self.num_cells * self.cell_nodes
