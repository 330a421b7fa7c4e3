"""Horizontal scale: several proxy worker processes serving one run, each execution pinned to one.

    coordinator ─create_execution(id)─> worker_of(id) ─> that worker's URL and key ─> the sandbox
                ─add_engine / drain / stop_admission / activate / remove─> every worker
    worker k: its executions' records (one writer per file), its own routing table over the
              shared engines (sticky sessions balance by its own calls in flight)

One proxy process is one Python event loop: its CPU per call bounds a run's calls per second. Workers
share nothing but the engines and the records directory; an execution's calls all reach the worker
it is pinned to (`gyre.proxy.executions.worker_of`: a hash of its id, stable across restarts), so
its records file keeps a single writer and its turn memory and conversation snapshots stay in one
process. The admin token is shared; `WorkersAdmin` is `gyre.proxy.admin.ProxyAdmin` over them all.
"""

import asyncio
import dataclasses
import secrets

from gyre.proxy.admin import ProxyAdmin
from gyre.proxy.config import ProxyConfig
from gyre.proxy.executions import worker_of
from gyre.proxy.main import ProxyProcess


class ProxyWorkers:
    """`num_workers` `gyre-proxy` processes over one records directory; `start()` before use."""

    def __init__(self, cfg: ProxyConfig, num_workers: int, startup_timeout_s: float = 60.0):
        self.admin_token = cfg.admin_token or secrets.token_urlsafe(24)
        self.workers = [
            ProxyProcess(
                dataclasses.replace(cfg, admin_token=self.admin_token, num_workers=num_workers, worker_index=i),
                startup_timeout_s,
            )
            for i in range(num_workers)
        ]

    def start(self) -> "ProxyWorkers":
        try:  # from this thread: a child dies with the thread that spawned it (gyre.common.spawn)
            for w in self.workers:
                w.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for w in self.workers:
            w.stop()

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def url_for(self, execution_id: str) -> str:
        """The base URL a sandbox of `execution_id` must use (its worker's)."""
        return self.workers[worker_of(execution_id, len(self.workers))].url

    def admin(self, timeout_s: float = 60.0) -> "WorkersAdmin":
        return WorkersAdmin(self.urls, self.admin_token, timeout_s)


_PER_WORKER = ("num_inflight", "num_sessions", "context_tokens", "output_tokens", "call_s", "busy_s")
"""An engine's figures each worker counts for its own calls (their sum is the engine's; busy_s
sums to the workers' busy time, an upper bound of the engine's)."""


class WorkersAdmin:
    """`gyre.proxy.admin.ProxyAdmin`'s calls over all workers (use as an async context manager):
    executions go to their worker, engine changes to every worker, metrics are summed."""

    def __init__(self, urls: list[str], token: str, timeout_s: float = 60.0):
        self.urls = urls
        self.admins = [ProxyAdmin(u, token, timeout_s) for u in urls]

    async def __aenter__(self) -> "WorkersAdmin":
        for a in self.admins:
            await a.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        for a in self.admins:
            await a.__aexit__(*exc)

    def _pinned(self, execution_id: str) -> int:
        return worker_of(execution_id, len(self.admins))

    async def create_execution(self, execution_id: str) -> dict:
        """Register an execution on its worker; returns {api_key, records_path, url} (hand the sandbox `url`)."""
        k = self._pinned(execution_id)
        return {**await self.admins[k].create_execution(execution_id), "url": self.urls[k]}

    async def revoke_execution(self, execution_id: str) -> dict:
        return await self.admins[self._pinned(execution_id)].revoke_execution(execution_id)

    async def add_engine(self, engine_id: str, url: str, cell_id: str) -> list[dict]:
        return await asyncio.gather(*(a.add_engine(engine_id, url, cell_id) for a in self.admins))

    async def engine_op(self, engine_id: str, op: str) -> list[dict]:
        """`op` (drain, activate, stop_admission) on every worker."""
        return await asyncio.gather(*(a.engine_op(engine_id, op) for a in self.admins))

    async def metrics(self) -> dict:
        """One /admin/metrics for the run: counters and each engine's calls in flight and sessions
        summed over the workers (an engine's status is the same on all), executions merged."""
        parts = await asyncio.gather(*(a.metrics() for a in self.admins))
        out = {k: sum(p[k] for p in parts) for k, v in parts[0].items() if isinstance(v, int) and k != "worker_index"}
        engines: dict[str, dict] = {}
        for p in parts:
            for e in p["engines"]:
                seen = engines.setdefault(e["engine_id"], {**e, **dict.fromkeys(_PER_WORKER, 0)})
                for k in _PER_WORKER:
                    seen[k] += e[k]
        return {
            **out,
            "engines": list(engines.values()),
            "executions": {k: v for p in parts for k, v in p["executions"].items()},
        }
