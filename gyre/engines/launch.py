"""Start a rollout server as a child process and wait until it answers /health.

`make_sglang_command`/`make_sglang_env` are pure (golden-tested); the process classes spawn, poll,
stop, and own what differs between backends in a role switch and a weight load (`release`/`resume`,
`load`: SGLang pauses and opens a weight-update session; gyre.engines.weights.serve_weights). SGLang path:
needs a GPU node with sglang 0.5.x installed (marked `gpu` in tests), or `engine.sglang_fake`.
"""

import asyncio
import contextlib
import dataclasses
import os
import sys
import time
from abc import ABC, abstractmethod

from gyre.common.files import write_child_config
from gyre.common.ports import PortReservation
from gyre.common.serve import ChildServer, ChildServerError
from gyre.common.wait import wait_until_async
from gyre.engines.client import EngineClient
from gyre.engines.config import EngineConfig
from gyre.engines.published import PublishedWeights
from gyre.engines.weights import load_weights
from gyre.models.config import ModelConfig
from gyre.transfer.config import TransferConfig


class EngineLaunchError(ChildServerError):
    """The server exited or did not become healthy in time; carries the tail of its log."""


def make_sglang_command(
    cfg: EngineConfig,
    port: int,
    python: str = sys.executable,
    base_gpu_id: int = 0,
    module: str = "sglang.launch_server",
) -> list[str]:
    """The `sglang.launch_server` command line for `cfg` on `port`, serving from GPUs
    `base_gpu_id` .. `base_gpu_id + cfg.tp_size / cfg.nnodes - 1` of this node (one server per
    `tp_size` GPUs). It listens on `cfg.listen_host`; a server spanning nodes (`cfg.nnodes` > 1) is
    one such process per node, `cfg.node_rank` its node (SGLang 0.5.21 `srt/arg_groups/fields/parallel.py`;
    node ranks >= 1 serve no HTTP: `srt/entrypoints/http_server.py` launch_server)."""
    cmd = [
        python,
        "-m",
        module,
        "--model-path",
        str(cfg.model_path),
        "--host",
        cfg.listen_host,
        "--port",
        str(port),
        "--tp-size",
        str(cfg.tp_size),
        "--base-gpu-id",
        str(base_gpu_id),
        "--mem-fraction-static",
        str(cfg.mem_fraction_static),
        "--page-size",
        str(cfg.page_size),
        "--load-format",
        cfg.load_format,
        "--weight-version",
        str(cfg.weight_version),
    ]
    if (cfg.nnodes or 1) > 1:
        if not cfg.dist_init_addr:
            raise ValueError(f"a server on {cfg.nnodes} nodes needs node rank 0's dist_init_addr (host:port)")
        cmd += ["--nnodes", str(cfg.nnodes), "--node-rank", str(cfg.node_rank), "--dist-init-addr", cfg.dist_init_addr]
    if cfg.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if cfg.enable_hicache:
        cmd += [
            "--enable-hierarchical-cache",
            "--hicache-ratio",
            str(cfg.hicache_ratio),
            "--hicache-write-policy",
            cfg.hicache_write_policy,
            "--hicache-storage-backend",
            cfg.hicache_storage_backend,
        ]
    return cmd + list(cfg.extra_args)


def make_sglang_env(cfg: EngineConfig, base: dict[str, str]) -> dict[str, str]:
    """Environment for the SGLang child: `/health` without a generation, and the shared Mooncake
    store that HiCache uses as L3.

    SGLang 0.5.21's `/health` runs a one-token generation unless
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 (`srt/entrypoints/http_server.py`): it waits while
    generation is paused and behind a weight load, and fails while memory is released, so the
    proxy's probes would mark an engine dead in every switch. (`/ready` answers 503 while paused:
    a readiness route, not the liveness the probes ask.) `/health_generate` still generates.
    """
    env = dict(base) | {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
    if cfg.enable_hicache and cfg.hicache_storage_backend == "mooncake":
        fabric = TransferConfig.from_env(base)  # the run's transfer.* (gyre.transfer.config)
        env |= {
            "MOONCAKE_MASTER": cfg.mooncake_master,
            "MOONCAKE_PROTOCOL": cfg.mooncake_protocol or fabric.protocol,
            "MOONCAKE_DEVICE": fabric.device,
            "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
        }
    return env


def advertised_url(cfg: EngineConfig, port: int) -> str:
    """The URL handed to the proxy and the cell: `cfg.host`, the address others reach, never the
    interface the server binds (`cfg.bind_host` may be 0.0.0.0, which no other node can dial)."""
    return f"http://{cfg.host}:{port}"


class BaseEngineProcess(ChildServer, ABC):
    """A rollout server child process; `url` is valid after `start()`. Use as a context manager.

    The engine seam: a backend implements `start` (and `client`, when its server needs other client
    options) and serves the HTTP endpoints `EngineClient` calls, SGLang 0.5.x's (/generate:
    gyre.engines.protocol); every caller talks to any backend through the one `EngineClient`.
    """

    error = EngineLaunchError

    def __init__(self, cfg: EngineConfig):
        super().__init__("gyre-engine")
        self.cfg = cfg
        self.url = ""

    @abstractmethod
    def start(self) -> None:
        """Spawn the server, set `url`, and return once it answers /health (`wait_healthy`)."""

    async def wait_healthy(self) -> None:
        """Poll /health until 200, failing fast if the child dies; bounded by startup_timeout_s."""
        last_log = time.monotonic()
        async with EngineClient(self.url, timeout_s=5) as c:

            async def healthy() -> bool:
                nonlocal last_log
                if await c.health():
                    return True
                self.check_alive()
                if time.monotonic() - last_log > 30:
                    print(f"waiting for {self.url}/health ...", file=sys.stderr)
                    last_log = time.monotonic()
                return False

            if not await wait_until_async(healthy, self.cfg.startup_timeout_s, interval_s=0.1):
                tail = self.log_tail()
                self.stop()
                raise EngineLaunchError(
                    f"{self.url} not healthy after {self.cfg.startup_timeout_s} s; log tail:\n{tail}"
                )

    def client(self, timeout_s: float | None = None) -> EngineClient:
        """A client for this engine (use as `async with`)."""
        return EngineClient(self.url, timeout_s or self.cfg.request_timeout_s)

    async def load(self, client: EngineClient, weights: PublishedWeights) -> None:
        """Load `weights` (gyre.engines.weights.serve_weights is the one caller that serves them)."""
        await load_weights(client, weights)

    async def release(self, client: EngineClient) -> None:
        """Free the engine's memory for training (the proxy has drained its calls already)."""
        await client.release_memory()

    async def resume(self, client: EngineClient) -> None:
        """Take the memory back before loading weights and serving again."""
        await client.resume_memory()


class BuiltinEngineProcess(BaseEngineProcess):
    """`python -m gyre.engines.server` on a free port (the child reports it through a file)."""

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, threads: int = 1):
        super().__init__(cfg)
        self.model_cfg, self.threads = model_cfg, threads

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "gyre.engines.server",
            "--config",
            write_child_config(
                self.files() / "config.json",
                {"engine": dataclasses.asdict(self.cfg), "model": dataclasses.asdict(self.model_cfg)},
            ),
        ]
        env = os.environ | {"OMP_NUM_THREADS": str(self.threads), "TMPDIR": str(self.files())}  # its scratch
        (port,) = self.spawn_and_wait_port(cmd, self.cfg.startup_timeout_s, env)
        self.url = advertised_url(self.cfg, port)
        asyncio.run(self.wait_healthy())


class SGLangProcess(BaseEngineProcess):
    """`sglang.launch_server` from config (GPU nodes), or with `engine.sglang_fake` the contract
    fake (gyre.engines.sglang_fake) on the very same command line."""

    def __init__(self, cfg: EngineConfig, base_gpu_id: int = 0):
        super().__init__(cfg)
        self.base_gpu_id = base_gpu_id

    def start(self) -> None:
        """Node rank 0 (every server on one node) serves HTTP at `url` once healthy; a node rank >= 1
        runs only its node's schedulers, so it has no URL and nothing to wait for here (its node
        rank 0 turns healthy once every node joined). Without `cfg.port`, a free port is reserved
        until the server answers (gyre.common.ports: SGLang takes its port by number)."""
        with contextlib.nullcontext(self.cfg.port) if self.cfg.port else PortReservation() as port:
            module = "gyre.engines.sglang_fake" if self.cfg.sglang_fake else "sglang.launch_server"
            cmd = make_sglang_command(self.cfg, port, base_gpu_id=self.base_gpu_id, module=module)
            self.spawn(cmd, make_sglang_env(self.cfg, dict(os.environ)))
            if self.cfg.node_rank == 0:
                self.url = advertised_url(self.cfg, port)
                asyncio.run(self.wait_healthy())

    def client(self, timeout_s: float | None = None) -> EngineClient:
        return EngineClient(self.url, timeout_s or self.cfg.request_timeout_s, key_by_weight_version=True)

    async def load(self, client: EngineClient, weights: PublishedWeights) -> None:
        """SGLang's update takes a write lock that waits for every /generate in flight: pause first
        (`engine.pause_mode`), then continue. A distributed or tensor load must run inside a weight
        update session (0.5.21 refuses it otherwise: srt/managers/scheduler_components/weight_updater.py);
        one from disk needs none."""
        await client.pause(self.cfg.pause_mode)
        try:
            if weights.sync == "disk":
                await load_weights(client, weights)
                return
            await client.begin_weight_update()
            try:
                await load_weights(client, weights, flush_cache=self.cfg.pause_mode != "in_place")
            finally:
                await client.end_weight_update()
        finally:
            await client.resume()

    async def release(self, client: EngineClient) -> None:
        # SGLang releases only an idle engine: abort what is left (a straggler the proxy's drain missed)
        await client.pause("abort")
        await client.release_memory()

    async def resume(self, client: EngineClient) -> None:
        await client.resume_memory()
        await client.resume()  # /continue_generation: undo the pause of `release`


def make_engine_process(cfg: EngineConfig, model_cfg: ModelConfig, base_gpu_id: int = 0) -> BaseEngineProcess:
    """The one factory of engine servers: `engine.backend` picks the process (cell leaders and
    `gyre-engine` start theirs here). A cell runs one per node on CPU and one per `engine.tp_size`
    ranks on GPU, each from its first GPU `base_gpu_id` (gyre.cells.serving.plan_engines)."""
    return SGLangProcess(cfg, base_gpu_id) if cfg.backend == "sglang" else BuiltinEngineProcess(cfg, model_cfg)


def attach_engine(cfg: EngineConfig, model_cfg: ModelConfig, url: str) -> BaseEngineProcess:
    """A handle on an engine another process started and stops (a Slurm cell's other node,
    gyre.cells.serving): its backend's client and switch verbs at `url`; `stop` does nothing."""
    engine = make_engine_process(cfg, model_cfg)
    engine.url = url
    return engine
