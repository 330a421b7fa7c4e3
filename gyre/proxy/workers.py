"""Horizontal scale: several proxy worker processes serving one run, each execution pinned to one.

    coordinator ─create_execution(id)─> worker_of(id) ─> that worker's URL and key ─> the sandbox
                ─add_engine / drain / stop_admission / activate / remove─> every worker
    worker k: its executions' records (one writer per file), its own routing table over the
              shared engines (sticky sessions balance by its own calls in flight)

One proxy process is one Python event loop: its CPU per call bounds a run's calls per second. Workers
share nothing but the engines and the records directory; an execution's calls all reach the worker
it is pinned to (`gyre.proxy.executions.worker_of`: a hash of its id, stable across restarts), so
its records file keeps a single writer and its turn memory and conversation snapshots stay in one
process. The admin token is shared; admin calls are plain blocking HTTP (they are rare).
"""

import dataclasses
import json
import secrets
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from gyre.errors import GyreError
from gyre.proxy.config import ProxyConfig
from gyre.proxy.executions import worker_of
from gyre.proxy.main import ProxyProcess


class ProxyAdminError(GyreError):
    """An admin call a worker refused; carries its status and answer."""


class ProxyWorkers:
    """`num_workers` `gyre-proxy` processes over one records directory; `start()` before use."""

    def __init__(self, cfg: ProxyConfig, num_workers: int, startup_timeout_s: float = 60.0):
        token = cfg.admin_token or secrets.token_urlsafe(24)
        self.admin_token = token
        self.workers = [ProxyProcess(dataclasses.replace(cfg, admin_token=token, num_workers=num_workers, worker_index=i),
                                     startup_timeout_s) for i in range(num_workers)]  # fmt: skip

    def start(self) -> "ProxyWorkers":
        try:  # in parallel: each imports the proxy's stack (seconds)
            with ThreadPoolExecutor(len(self.workers)) as pool:
                list(pool.map(ProxyProcess.start, self.workers))
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

    def _call(self, url: str, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {self.admin_token}", "Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ProxyAdminError(f"{method} {url}{path} -> HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None

    def create_execution(self, execution_id: str, api_key: str | None = None) -> dict:
        """Register an execution on its worker: {execution_id, api_key, records_path} plus `url`."""
        url = self.url_for(execution_id)
        body = {"execution_id": execution_id, **({"api_key": api_key} if api_key else {})}
        return {**self._call(url, "POST", "/admin/executions", body), "url": url}

    def revoke_execution(self, execution_id: str) -> dict:
        return self._call(self.url_for(execution_id), "DELETE", f"/admin/executions/{execution_id}")

    def add_engine(self, engine_id: str, url: str, cell_id: str = "") -> list[dict]:
        return [self._call(w.url, "POST", "/admin/engines", {"engine_id": engine_id, "url": url, "cell_id": cell_id}) for w in self.workers]

    def engine_op(self, engine_id: str, op: str) -> list[dict]:
        """`op` (stop_admission, drain, activate) on every worker; `remove` deletes the engine."""
        if op == "remove":
            return [self._call(w.url, "DELETE", f"/admin/engines/{engine_id}") for w in self.workers]
        return [self._call(w.url, "POST", f"/admin/engines/{engine_id}/{op}") for w in self.workers]

    def metrics(self) -> list[dict]:
        """Each worker's /admin/metrics (engines' load is per worker: sum them for an engine's total)."""
        return [self._call(w.url, "GET", "/admin/metrics") for w in self.workers]
