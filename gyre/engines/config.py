"""Engine config: which server serves rollouts (builtin CPU engine or SGLang) and how it is launched."""

from dataclasses import dataclass, field

from gyre.engines.published import WEIGHT_SYNCS
from gyre.errors import require
from gyre.transfer.config import PROTOCOLS

BACKENDS = ("builtin", "sglang")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
"""Addresses a server may bind but nobody can dial (engine.bind_host, not engine.host)."""
PAUSE_MODES = ("in_place", "retract", "abort")
"""SGLang 0.5.x /pause_generation modes (srt/managers/io_struct.py PauseGenerationReqInput)."""


@dataclass(kw_only=True)
class EngineConfig:
    """One rollout server. Both backends speak the SGLang HTTP contract (DESIGN.md)."""

    backend: str = "builtin"
    """`builtin` (Gyre's CPU engine, `gyre-engine`) or `sglang` (sglang.launch_server on GPUs)."""
    host: str = "127.0.0.1"
    """The address others dial: the URL the proxy is handed is http://host:port, so it must be one
    that the proxy's node reaches (on Slurm: the node's own, gyre.cells.slurm), never a wildcard."""
    bind_host: str | None = None
    """The interface the server listens on (SGLang's --host); None: `host`. `0.0.0.0` listens on all
    of the node's interfaces while the proxy still dials `host`."""
    port: int = 0
    """0 picks a free port (the launcher reads it back)."""
    model_path: str | None = None
    """Model directory (config.json + weights). Builtin: None means random weights from `init_seed`."""
    init_seed: int = 0
    """Seed of the builtin engine's random initial weights (when model_path is None)."""
    weight_version: int = 0
    """Version reported for the initial weights (the trainer's step); updates replace it."""
    max_running_requests: int = 32
    """Requests decoded together in one batch (continuous batching); more wait in a queue."""
    max_prefill_tokens: int = 2048
    """Prompt tokens prefilled per engine step (chunked prefill keeps decodes flowing)."""
    page_size: int = 16
    """Prefix-cache granularity in tokens (SGLang's --page-size)."""
    prefix_cache_tokens: int = 262144
    """Builtin prefix-cache capacity in tokens (LRU eviction beyond it)."""
    kv_arena_mib: int = 32
    """Builtin: MiB of memory touched at start (and registered with Mooncake: > 0 opens the engine's
    endpoint at start, not in its first hand-off) that KV hand-offs copy exports into and read
    imports into (an import stays there as prefix-cache pages until evicted); beyond it they use new
    memory, whose page faults double each copy's cost. Kept across release_memory (only the cache's
    pages in it are freed). 0: none."""
    startup_timeout_s: float = 600.0
    """Launchers give up if /health does not answer 200 within this time."""
    request_timeout_s: float = 3600.0
    """Client-side timeout of one HTTP call to the engine."""
    tp_size: int = 1
    """SGLang tensor parallelism (GPUs per server): on GPU a cell runs one server per tp_size of its
    ranks on a node, which tp_size must divide (gyre.cells.serving)."""
    nnodes: int | None = None
    """SGLang: nodes one server spans (--nnodes), all GPUs of each of nnodes consecutive nodes of its
    cell (a TP group wider than a node); one server process per node, and only node rank 0's serves
    HTTP and registers with the proxy (gyre.cells.serving). None: the nodes tp_size GPUs fill (1 when
    they fit on one); a cell sets it per process from its plan."""
    node_rank: int = 0
    """SGLang with nnodes > 1: this process's node among its server's (--node-rank); set per process
    by the cell that starts it, not in config."""
    dist_init_addr: str = ""
    """SGLang with nnodes > 1: host:port of node rank 0's torch.distributed rendezvous
    (--dist-init-addr); set per server by the cell that starts it, not in config."""
    mem_fraction_static: float = 0.85
    """SGLang: GPU memory fraction for weights + KV pool."""
    enable_memory_saver: bool = True
    """SGLang: needed for /release_memory_occupation (a cell switching to TRAIN frees the GPU)."""
    enable_hicache: bool = True
    """SGLang: hierarchical KV cache (GPU -> host -> L3 store)."""
    hicache_storage_backend: str = "mooncake"
    hicache_write_policy: str = "write_through"
    hicache_ratio: float = 2.0
    """SGLang: host KV pool size as a multiple of the GPU pool."""
    mooncake_master: str = ""
    """host:port of the shared mooncake_master (the L3 store all servers see); required with HiCache."""
    mooncake_protocol: str | None = None
    """Mooncake transport of the HiCache store (`tcp` or `rdma`). None: the run's transfer.protocol,
    as every other Mooncake endpoint (gyre.transfer.config)."""
    load_format: str = "auto"
    """SGLang --load-format (`dummy` for random weights in tests)."""
    weight_sync: str = "mooncake"
    """How engines load each published version (gyre.engines.published.WEIGHT_SYNCS): `mooncake`
    (builtin only), `distributed` (SGLang's update_weights_from_distributed: NCCL, gloo on CPU) or
    `disk` (update_weights_from_disk of an HF directory under the run directory's `weights/`)."""
    pause_mode: str = "retract"
    """SGLang: how generation pauses around a weight update (/pause_generation `mode`). `retract`
    keeps the calls in flight and re-prefills them under the new weights, so they go on across the
    update with a version span each, as on the builtin engine (whose tokens after an update are the
    new weights' too); `in_place` keeps their KV (the update then does not flush SGLang's cache:
    0.5.21 exits flushing a cache that running calls hold); `abort` ends them (the harness retries)."""
    sglang_fake: bool = False
    """Tests on CPU: launch gyre.engines.sglang_fake, the SGLang contract fake, on SGLang's command
    line instead of sglang.launch_server (engine.backend=sglang only)."""
    scripted_policy: str | None = None
    """Builtin, tests only: JSON rules file of a scripted policy (gyre.engines.scripted) that forces
    the emitted tokens for matching prompts; log-probs stay the model's."""
    extra_args: list[str] = field(default_factory=list)
    """Extra sglang.launch_server flags, passed through verbatim."""

    @property
    def listen_host(self) -> str:
        """The interface the server binds (`bind_host`, else `host`)."""
        return self.bind_host or self.host

    @property
    def on_gpu(self) -> bool:
        """Serves from GPUs (SGLang itself), so a cell runs an engine per tp_size ranks, not per node."""
        return self.backend == "sglang" and not self.sglang_fake

    def __post_init__(self):
        require(self.backend in BACKENDS, "backend", f"must be one of {list(BACKENDS)}, got {self.backend!r}")
        require(0 <= self.port < 65536, "port", f"must be 0..65535, got {self.port}")
        require(
            self.weight_version >= 0,
            "weight_version",
            f"must be an integer >= 0 (the trainer's step), got {self.weight_version}",
        )
        require(
            self.max_running_requests >= 1, "max_running_requests", f"must be >= 1, got {self.max_running_requests}"
        )
        require(self.max_prefill_tokens >= 1, "max_prefill_tokens", f"must be >= 1, got {self.max_prefill_tokens}")
        require(self.page_size >= 1, "page_size", f"must be >= 1, got {self.page_size}")
        require(self.prefix_cache_tokens >= 0, "prefix_cache_tokens", f"must be >= 0, got {self.prefix_cache_tokens}")
        require(self.kv_arena_mib >= 0, "kv_arena_mib", f"must be >= 0 (0: no arena), got {self.kv_arena_mib}")
        require(self.tp_size >= 1, "tp_size", f"must be >= 1, got {self.tp_size}")
        self._check_placement()
        require(
            0 < self.mem_fraction_static < 1,
            "mem_fraction_static",
            f"must be in (0, 1), got {self.mem_fraction_static}",
        )
        require(
            self.weight_sync in WEIGHT_SYNCS,
            "weight_sync",
            f"must be one of {list(WEIGHT_SYNCS)}, got {self.weight_sync!r}",
        )
        require(
            not (self.backend == "sglang" and self.weight_sync == "mooncake"),
            "weight_sync",
            "SGLang cannot read Gyre's Mooncake buffers (load_format=gyre_transfer is Gyre's own): "
            "use distributed or disk",
        )
        require(
            self.pause_mode in PAUSE_MODES,
            "pause_mode",
            f"must be one of {list(PAUSE_MODES)}, got {self.pause_mode!r}",
        )
        require(
            not self.sglang_fake or self.backend == "sglang",
            "sglang_fake",
            "the SGLang contract fake stands in for SGLang: set engine.backend=sglang (engine=sglang)",
        )
        require(
            self.mooncake_protocol in (None, *PROTOCOLS),
            "mooncake_protocol",
            f"must be one of {list(PROTOCOLS)} or null (transfer.protocol), got {self.mooncake_protocol!r}",
        )
        require(self.startup_timeout_s > 0, "startup_timeout_s", f"must be > 0, got {self.startup_timeout_s}")
        require(
            self.backend != "sglang" or self.model_path is not None,
            "model_path",
            "SGLang needs a model directory (use load_format=dummy for random weights)",
        )
        require(
            not (self.backend == "sglang" and self.enable_hicache and self.hicache_storage_backend == "mooncake")
            or bool(self.mooncake_master),
            "mooncake_master",
            "HiCache with the mooncake L3 store needs the shared mooncake_master host:port (or enable_hicache=false)",
        )

    def _check_placement(self) -> None:
        """An address others can dial; a server spanning nodes: SGLang only, an equal share of its
        tp_size GPUs on each node."""
        require(
            self.host not in WILDCARD_HOSTS,
            "host",
            f"{self.host!r} is a bind address, not one the proxy can dial: set engine.host to the node's "
            f"address and engine.bind_host={self.host or '0.0.0.0'} to listen on all interfaces",
        )
        nnodes = self.nnodes or 1
        require(self.nnodes is None or self.nnodes >= 1, "nnodes", f"must be >= 1 or null, got {self.nnodes}")
        require(
            nnodes == 1 or self.backend == "sglang",
            "nnodes",
            "only an SGLang server spans nodes (engine=sglang); the builtin engine serves from one",
        )
        require(
            self.tp_size % nnodes == 0,
            "nnodes",
            f"{nnodes} nodes do not share engine.tp_size={self.tp_size} GPUs equally "
            "(SGLang runs tp_size / nnodes on each)",
        )
        require(0 <= self.node_rank < nnodes, "node_rank", f"must be 0..{nnodes - 1}, got {self.node_rank}")
