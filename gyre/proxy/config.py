"""Proxy config: where it listens, what it serves, how long calls wait, where records go."""

from dataclasses import dataclass, field

from gyre.errors import require

ADMIN_TIMEOUT_S = 60.0
"""Client timeout of an admin call (gyre.proxy.admin): a cell leader's drain waits for the hand-off."""
HAND_OFF_SLACK_S = 10.0
"""Time a hand-off takes beyond its moves' timeout (aborts, the last wait for its calls)."""


@dataclass(kw_only=True)
class ProxyConfig:
    """One proxy process (one per rollout deployment; every harness sandbox talks to it)."""

    host: str = "127.0.0.1"
    """Interface to bind; loopback by default, a cluster deployment sets the node's interface."""
    port: int = 0
    """0 picks a free port (written to `port_file` once listening)."""
    admin_token: str = ""
    """Bearer token of the admin API (engines, drains, executions, metrics); empty: generated at start."""
    records_dir: str = "records"
    """One `<execution_id>.jsonl` records file per execution."""
    events_dir: str | None = None
    """A run directory whose events.jsonl gets one ModelCall event per answered call (None: none)."""
    model_names: list[str] = field(default_factory=lambda: ["gyre"])
    """Model names harnesses may ask for (others: 404 in the API's format)."""
    context_len: int = 32768
    """Prompt + output token limit; longer prompts are refused with the API's prompt-too-long error
    (0 in a run's config: the model's max_seq_len, filled in by gyre.config)."""
    default_max_tokens: int = 4096
    """OpenAI requests without max_tokens get this many."""
    temperature: float | None = None
    """Sampling temperature forced on every call (on-policy RL); None: the request's (default 1)."""
    no_engine_wait_s: float = 60.0
    """How long a call waits for an active engine before an overloaded error."""
    health_interval_s: float = 1.0
    """Seconds between /health checks of each engine (a failed check marks it dead)."""
    request_timeout_s: float = 3600.0
    """Client timeout of one engine call."""
    max_imbalance: int = 4
    """A session leaves its sticky engine when that has this many more calls in flight than the least loaded."""
    max_resumes: int = 16
    """Reroutes one call may take (drains, crashes) before it fails."""
    migrate_kv: bool = True
    """On a hand-off (drain), move each session's KV (calls in flight and sessions between calls) to
    its new engine where both engines support it; off: their next calls recompute it (counted in
    kv_reprefill_tokens)."""
    kv_move_timeout_s: float = 30.0
    """A session's KV move not done within this is given up (recomputed, counted), and a hand-off
    waits at most this long for its moves before the engine may release memory."""
    rebalance_on_return: bool = False
    """An engine that (re)turns active takes idle sessions, with their KV, from the most loaded
    engines until loads are even within one session (a run sets it from scheduler.rebalance_on_return)."""
    fsync: bool = True
    """fsync records (see fsync_window_ms); off only in benchmarks of the HTTP path."""
    fsync_window_ms: float = 50.0
    """Group commit: each record is written (page cache: survives a proxy kill) before its call is
    answered, and fsynced by a background thread within this many ms (plus the fsyncs under way,
    ~10-50 ms), so a machine crash loses at most the last window and no call waits for the disk;
    a longer window batches more files per fsync round. 0: fsync every record before
    answering (durable per call; adds an fsync, 5-15 ms on a shared disk, to every call)."""
    engines: list[str] = field(default_factory=list)
    """Engine URLs registered at start (ids e0, e1, ...); more come through the admin API."""
    tokenizer_path: str | None = None
    """Model directory of the served model's tokenizer: its `bpe.json` (a warm-started tiny model;
    gyre-train sets this to the warm start's directory) or its Hugging Face tokenizer files;
    None: Gyre's byte tokenizer."""
    vocab_size: int = 512
    """Vocabulary size of the served model (the byte and BPE tokenizers' ids, specials included)."""
    max_body_mb: int = 64
    """Largest request body accepted (413 beyond)."""
    num_workers: int = 1
    """Proxy worker processes serving the run (gyre.proxy.workers); each execution is pinned to one."""
    worker_index: int = 0
    """This process's worker (0..num_workers-1): it serves only the executions pinned to it."""

    def __post_init__(self):
        require(0 <= self.port < 65536, "port", f"must be 0..65535, got {self.port}")
        require(bool(self.model_names), "model_names", "must name at least one model")
        require(
            self.context_len == 0 or self.context_len >= 2,
            "context_len",
            f"must be >= 2 (0: the served model's max_seq_len), got {self.context_len}",
        )
        require(self.default_max_tokens >= 1, "default_max_tokens", f"must be >= 1, got {self.default_max_tokens}")
        require(
            self.temperature is None or self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}"
        )
        require(self.no_engine_wait_s >= 0, "no_engine_wait_s", f"must be >= 0, got {self.no_engine_wait_s}")
        require(self.health_interval_s > 0, "health_interval_s", f"must be > 0, got {self.health_interval_s}")
        require(self.max_imbalance >= 0, "max_imbalance", f"must be >= 0, got {self.max_imbalance}")
        require(self.max_resumes >= 0, "max_resumes", f"must be >= 0, got {self.max_resumes}")
        require(
            0 < self.kv_move_timeout_s <= ADMIN_TIMEOUT_S - HAND_OFF_SLACK_S,
            "kv_move_timeout_s",
            f"must be in (0, {ADMIN_TIMEOUT_S - HAND_OFF_SLACK_S:g}] s, so a hand-off ends within the cell "
            f"leader's {ADMIN_TIMEOUT_S:g} s admin timeout; got {self.kv_move_timeout_s}",
        )
        require(0 <= self.fsync_window_ms <= 10_000, "fsync_window_ms", f"must be 0..10000, got {self.fsync_window_ms}")
        require(self.max_body_mb >= 1, "max_body_mb", f"must be >= 1, got {self.max_body_mb}")
        require(self.num_workers >= 1, "num_workers", f"must be >= 1, got {self.num_workers}")
        require(
            0 <= self.worker_index < self.num_workers,
            "worker_index",
            f"must be 0..{self.num_workers - 1}, got {self.worker_index}",
        )
