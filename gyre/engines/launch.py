"""Start a rollout server as a child process and wait until it answers /health.

`make_sglang_command`/`make_sglang_env` are pure (golden-tested); the process classes only spawn,
poll and stop. SGLang path: needs a GPU node with sglang 0.5.x installed (marked `gpu` in tests).
"""

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gyre.engines.client import EngineClient
from gyre.engines.config import EngineConfig
from gyre.errors import GyreError
from gyre.models.config import ModelConfig


class EngineLaunchError(GyreError):
    """The server exited or did not become healthy in time; carries the tail of its log."""


def make_sglang_command(cfg: EngineConfig, port: int, python: str = sys.executable) -> list[str]:
    """The `sglang.launch_server` command line for `cfg` on `port`."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(cfg.model_path), "--host", cfg.host,
           "--port", str(port), "--tp-size", str(cfg.tp_size), "--mem-fraction-static", str(cfg.mem_fraction_static),
           "--page-size", str(cfg.page_size), "--load-format", cfg.load_format,
           "--weight-version", cfg.weight_version]  # fmt: skip
    if cfg.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if cfg.enable_hicache:
        cmd += ["--enable-hierarchical-cache", "--hicache-ratio", str(cfg.hicache_ratio),
                "--hicache-write-policy", cfg.hicache_write_policy,
                "--hicache-storage-backend", cfg.hicache_storage_backend]  # fmt: skip
    return cmd + list(cfg.extra_args)


def make_sglang_env(cfg: EngineConfig, base: dict[str, str]) -> dict[str, str]:
    """Environment for the SGLang child: the shared Mooncake store that HiCache uses as L3."""
    env = dict(base)
    if cfg.enable_hicache and cfg.hicache_storage_backend == "mooncake":
        env |= {"MOONCAKE_MASTER": cfg.mooncake_master, "MOONCAKE_PROTOCOL": cfg.mooncake_protocol,
                "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE"}  # fmt: skip
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BaseEngineProcess:
    """A server child process; `url` is valid after `start()`. Use as a context manager."""

    def __init__(self, cfg: EngineConfig, keep_log: bool = False):
        self.cfg, self.keep_log = cfg, keep_log
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="gyre-engine-", suffix=".log", delete=False)

    def _spawn(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, n: int = 3000) -> str:
        path = Path(self._log.name)
        return path.read_text(errors="replace")[-n:] if path.exists() else "(log removed)"

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.log_tail()
            self.stop()
            raise EngineLaunchError(f"engine exited with code {self.proc.returncode}; log tail:\n{tail}")

    async def wait_healthy(self) -> None:
        """Poll /health until 200, failing fast if the child dies; bounded by startup_timeout_s."""
        deadline, last_log = time.monotonic() + self.cfg.startup_timeout_s, time.monotonic()
        async with EngineClient(self.url, timeout_s=5) as c:
            while not await c.health():
                self._check_alive()
                if time.monotonic() > deadline:
                    tail = self.log_tail()
                    self.stop()
                    raise EngineLaunchError(f"{self.url} not healthy after {self.cfg.startup_timeout_s} s; log tail:\n{tail}")
                if time.monotonic() - last_log > 30:
                    print(f"waiting for {self.url}/health ...", file=sys.stderr)
                    last_log = time.monotonic()
                await asyncio.sleep(0.1)

    def client(self, timeout_s: float | None = None) -> EngineClient:
        return EngineClient(self.url, timeout_s or self.cfg.request_timeout_s)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the child's process group (SIGKILL after `timeout_s`); drop the log unless keep_log."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        if not self.keep_log and os.path.exists(self._log.name):
            os.unlink(self._log.name)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        raise NotImplementedError


class BuiltinEngineProcess(BaseEngineProcess):
    """`python -m gyre.engines.server` on a free port (the child reports it through a file)."""

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, threads: int = 1):
        super().__init__(cfg)
        self.model_cfg, self.threads = model_cfg, threads

    def start(self) -> None:
        port_file = self._log.name + ".port"
        cmd = [sys.executable, "-m", "gyre.engines.server", "--engine-json", json.dumps(dataclasses.asdict(self.cfg)),
               "--model-json", json.dumps(dataclasses.asdict(self.model_cfg)), "--port-file", port_file]  # fmt: skip
        env = os.environ | {"OMP_NUM_THREADS": str(self.threads)}
        self._spawn(cmd, env)
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while not os.path.exists(port_file):
            self._check_alive()
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise EngineLaunchError(f"no port reported after {self.cfg.startup_timeout_s} s; log tail:\n{tail}")
            time.sleep(0.05)
        self.url = f"http://{self.cfg.host}:{Path(port_file).read_text().strip()}"
        os.unlink(port_file)
        asyncio.run(self.wait_healthy())


class SGLangProcess(BaseEngineProcess):
    """`sglang.launch_server` from config (GPU nodes only)."""

    def start(self) -> None:
        port = self.cfg.port or free_port(self.cfg.host)
        self.url = f"http://{self.cfg.host}:{port}"
        self._spawn(make_sglang_command(self.cfg, port), make_sglang_env(self.cfg, dict(os.environ)))
        asyncio.run(self.wait_healthy())

    def client(self, timeout_s: float | None = None) -> EngineClient:
        return EngineClient(self.url, timeout_s or self.cfg.request_timeout_s, key_by_weight_version=True)


def make_engine_process(cfg: EngineConfig, model_cfg: ModelConfig) -> BaseEngineProcess:
    return SGLangProcess(cfg) if cfg.backend == "sglang" else BuiltinEngineProcess(cfg, model_cfg)
