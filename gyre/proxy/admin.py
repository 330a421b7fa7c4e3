"""The proxy's admin API from the other side: what the coordinator and cell leaders call (aiohttp)."""

import aiohttp

from gyre.errors import GyreError
from gyre.proxy.config import ADMIN_TIMEOUT_S


class ProxyAdminError(GyreError):
    """The proxy refused an admin call; carries its status and message."""


class ProxyAdmin:
    """Admin calls with the run's admin token. Use as an async context manager."""

    def __init__(self, url: str, token: str, timeout_s: float = ADMIN_TIMEOUT_S):
        self.url, self.token, self.timeout_s = url.rstrip("/"), token, timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "ProxyAdmin":
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self.token}"}, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        async with self._session.request(method, self.url + path, json=body) as r:
            out = await r.json(content_type=None)
            if r.status >= 400:
                raise ProxyAdminError(f"{method} {path}: {r.status} {out.get('error', {}).get('message', out)}")
            return out

    async def create_execution(self, execution_id: str) -> dict:
        """Register an execution; returns {api_key, records_path}."""
        return await self._call("POST", "/admin/executions", {"execution_id": execution_id})

    async def revoke_execution(self, execution_id: str) -> dict:
        return await self._call("DELETE", f"/admin/executions/{execution_id}")

    async def add_engine(self, engine_id: str, url: str, cell_id: str) -> dict:
        return await self._call("POST", "/admin/engines", {"engine_id": engine_id, "url": url, "cell_id": cell_id})

    async def engine_op(self, engine_id: str, op: str) -> dict:
        """`op` one of drain, activate, stop_admission."""
        return await self._call("POST", f"/admin/engines/{engine_id}/{op}")

    async def set_weight_version(self, engine_id: str, version: int | None) -> dict:
        """A load of `engine_id` ended: it serves `version` now (SGLang calls carry it as `extra_key`);
        None: the load failed, it serves what it served before. Its held calls go on."""
        body = {"loading": False} if version is None else {"weight_version": version}
        return await self._call("POST", f"/admin/engines/{engine_id}/weight_version", body)

    async def hold_calls(self, engine_id: str) -> dict:
        """A weight load of `engine_id` starts: its calls wait until `set_weight_version`."""
        return await self._call("POST", f"/admin/engines/{engine_id}/weight_version", {"loading": True})

    async def served_versions(self) -> dict[str, int | None]:
        """Engine id -> the weight version it serves (the proxy keeps it: the one place it lives)."""
        return {e["engine_id"]: e["weight_version"] for e in (await self.metrics())["engines"]}

    async def metrics(self) -> dict:
        return await self._call("GET", "/admin/metrics")
