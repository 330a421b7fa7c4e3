"""`gyre-proxy`'s HTTP edge: authentication, the two model APIs, and the admin API (aiohttp).

Harness side (per-execution key in `x-api-key`, `Authorization: Bearer`, or `x-gyre-key`):
    HEAD/GET /api/hello, POST /v1/messages[?beta=true], POST /v1/messages/count_tokens,
    POST /v1/chat/completions, POST /v1/responses, GET /v1/models
Admin side (`Authorization: Bearer <admin token>`):
    POST /admin/executions {execution_id, api_key?} -> {api_key}; DELETE /admin/executions/{id} (revoke);
    GET/POST /admin/engines {engine_id, url, cell_id?}; DELETE /admin/engines/{id};
    POST /admin/engines/{id}/stop_admission (phase 1 of leaving rollout: no new sessions) | /drain
    (phase 2: hand every session off with its KV; answers once every move has ended) | /activate
    (with rebalance_on_return, takes idle sessions from the most loaded engines);
    POST /admin/engines/{id}/weight_version {weight_version} (the version it serves now: SGLang's
    extra_key; a load ended) | {loading: true} (a load starts: its calls wait until it ends) | {loading:
    false} (the load failed: the engine serves what it served before);
    GET /admin/metrics (counters, each engine's and each execution's load)
Every error answers in the API's own format; a bad request never takes the proxy down.
"""

import asyncio
import hmac
import logging
import secrets
import time

from aiohttp import web

from gyre.common import jsonio
from gyre.errors import GyreError
from gyre.metrics.log import EventLog
from gyre.models.tokenizer import BaseTokenizer
from gyre.proxy.anthropic import AnthropicWire
from gyre.proxy.calls import CallRunner
from gyre.proxy.chat import ApiError, invalid
from gyre.proxy.config import ProxyConfig
from gyre.proxy.executions import ExecutionRegistry
from gyre.proxy.openai import OpenAIWire
from gyre.proxy.pool import EnginePool
from gyre.proxy.render import Renderer
from gyre.proxy.responses import ResponsesWire
from gyre.proxy.routing import RoutingError
from gyre.proxy.wire import BaseWire

log = logging.getLogger(__name__)


def _credentials(request: web.Request) -> list[str]:
    """The keys a request carries, in order: `Authorization: Bearer`, `x-api-key`, `x-gyre-key`."""
    auth = request.headers.get("Authorization", "")
    keys = [auth[7:].strip()] if auth.lower().startswith("bearer ") else []
    return keys + [request.headers[h] for h in ("x-api-key", "x-gyre-key") if h in request.headers]


async def _read_body(request: web.Request) -> bytes:
    """The body, its chunks joined once: aiohttp's `read()` grows a bytearray chunk by chunk, then
    copies it into bytes (at a million-token context, a 4 MB body, ~2 ms more CPU per call).

    Raises:
        ApiError: too_large past the app's `max_body` bytes.
    """
    limit = request.app["max_body"]
    if (request.content_length or 0) > limit:
        raise ApiError("too_large", f"request body exceeds {limit} bytes")
    chunks, size = [], 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            raise ApiError("too_large", f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _json(body, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=jsonio.dumps)


async def _json_body(request: web.Request) -> tuple[object, bytes]:
    """The parsed body and its bytes."""
    raw = await _read_body(request)
    try:
        return jsonio.loads(raw), raw
    except jsonio.DecodeError as e:
        raise invalid(f"malformed JSON body: {e}") from None


class ProxyServer:
    def __init__(self, cfg: ProxyConfig, tokenizer: BaseTokenizer):
        self.cfg = cfg
        self.admin_token = cfg.admin_token or secrets.token_urlsafe(24)
        self.tok = tokenizer
        self.renderer = Renderer(tokenizer)
        self.pool = EnginePool(cfg)
        self.executions = ExecutionRegistry(
            cfg.records_dir,
            cfg.fsync,
            tokenizer.parse_assistant,
            cfg.fsync_window_ms,
            (cfg.worker_index, cfg.num_workers),
        )
        self.events = EventLog(cfg.events_dir) if cfg.events_dir else None
        self.runner = CallRunner(cfg, tokenizer, self.renderer, self.pool, self.events)
        self.anthropic = AnthropicWire(cfg.model_names, cfg.default_max_tokens)
        self.openai = OpenAIWire(cfg.model_names, cfg.default_max_tokens)
        self.responses = ResponsesWire(cfg.model_names, cfg.default_max_tokens)
        self._create_lock = asyncio.Lock()
        """Serialises changes to the execution registry (creation runs in a thread: it fsyncs files)."""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_mb << 20)
        app["max_body"] = self.cfg.max_body_mb << 20
        app.add_routes(
            [
                web.get("/api/hello", self.hello),
                web.get("/health", self.hello),
                web.post("/v1/messages", self.messages),
                web.post("/v1/messages/count_tokens", self.count_tokens),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.post("/v1/responses", self.responses_api),
                web.post("/admin/executions", self.create_execution),
                web.delete("/admin/executions/{id}", self.revoke_execution),
                web.get("/admin/engines", self.list_engines),
                web.post("/admin/engines", self.add_engine),
                web.delete("/admin/engines/{id}", self.remove_engine),
                web.post("/admin/engines/{id}/drain", self.drain_engine),
                web.post("/admin/engines/{id}/activate", self.activate_engine),
                web.post("/admin/engines/{id}/weight_version", self.engine_weight_version),
                web.get("/admin/metrics", self.metrics),
                web.post("/admin/engines/{id}/stop_admission", self.stop_admission),
            ]
        )
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._close)
        return app

    async def _start(self, _app) -> None:
        await self.pool.start()
        for i, url in enumerate(self.cfg.engines):
            await self.pool.register(f"e{i}", url)

    async def _close(self, _app) -> None:
        await self.pool.close()
        self.executions.close()
        if self.events is not None:
            self.events.close()

    # --- harness side -------------------------------------------------------------------------
    async def hello(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def _execution(self, request: web.Request):
        for key in _credentials(request):
            ex = self.executions.lookup(key)
            if ex is not None:
                return ex
        raise ApiError("authentication", "invalid x-api-key: unknown or revoked execution credential")

    async def _chat(self, request: web.Request, wire: BaseWire) -> web.StreamResponse:
        t0 = time.monotonic()
        try:
            ex = self._execution(request)
            await ex.ready()
            body, raw = await _json_body(request)
            call = self.runner.prepare(ex, wire, body, request.headers, t0, raw)
            return await self.runner.respond(request, call, wire)
        except ApiError as e:
            status, body = wire.error(e)
            if e.kind == "overloaded":
                log.warning("%s", e)
            return _json(body, status=status)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._chat(request, self.anthropic)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._chat(request, self.openai)

    async def responses_api(self, request: web.Request) -> web.StreamResponse:
        return await self._chat(request, self.responses)

    async def count_tokens(self, request: web.Request) -> web.Response:
        try:
            ex = self._execution(request)
            await ex.ready()
            body, _ = await _json_body(request)
            if isinstance(body, dict):
                body = {**body, "max_tokens": body.get("max_tokens") or 1}
            _, _, rendered, _ = self.runner.render(ex, self.anthropic, body, request.headers, keep=False)
            return _json({"input_tokens": int(rendered.input_ids.size)})
        except ApiError as e:
            status, body = self.anthropic.error(e)
            return _json(body, status=status)

    async def models(self, request: web.Request) -> web.Response:
        try:
            self._execution(request)
        except ApiError as e:
            status, body = self.openai.error(e)
            return _json(body, status=status)
        return _json(
            {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "gyre"} for m in self.cfg.model_names]}
        )

    # --- admin side ---------------------------------------------------------------------------
    def _admin(self, request: web.Request) -> None:
        given = next((k for k in _credentials(request) if k), "")
        if not hmac.compare_digest(given.encode(), self.admin_token.encode()):
            raise web.HTTPUnauthorized(
                text=jsonio.dumps({"error": {"message": "admin token required"}}), content_type="application/json"
            )

    async def _admin_body(self, request: web.Request) -> dict:
        self._admin(request)
        try:
            body = jsonio.loads(await request.read() or b"{}")
        except jsonio.DecodeError as e:
            raise web.HTTPBadRequest(
                text=jsonio.dumps({"error": {"message": f"malformed JSON body: {e}"}}), content_type="application/json"
            ) from None
        return body if isinstance(body, dict) else {}

    @staticmethod
    def _bad(message: str, status: int = 400) -> web.Response:
        return _json({"error": {"message": message}}, status=status)

    async def create_execution(self, request: web.Request) -> web.Response:
        body = await self._admin_body(request)
        try:
            async with self._create_lock:  # one at a time, in a thread: opening a records file fsyncs
                ex = await asyncio.to_thread(self.executions.create, body.get("execution_id"), body.get("api_key"))
        except GyreError as e:
            return self._bad(str(e))
        return _json({"execution_id": ex.execution_id, "api_key": ex.key, "records_path": str(ex.records_path)})

    async def revoke_execution(self, request: web.Request) -> web.Response:
        self._admin(request)
        try:
            async with self._create_lock:  # not while a create runs in its thread (both change the registry)
                ex = self.executions.revoke(request.match_info["id"])
        except GyreError as e:
            return self._bad(str(e), 404)
        self.pool.forget(ex.execution_id)
        ex.conversations.clear()
        return _json({"execution_id": ex.execution_id, "revoked": True})

    async def list_engines(self, request: web.Request) -> web.Response:
        self._admin(request)
        return _json({"engines": self.pool.describe()})

    async def add_engine(self, request: web.Request) -> web.Response:
        body = await self._admin_body(request)
        if not isinstance(body.get("engine_id"), str) or not isinstance(body.get("url"), str):
            return self._bad("needs {engine_id: str, url: str}")
        try:
            return _json(await self.pool.register(body["engine_id"], body["url"], str(body.get("cell_id", ""))))
        except ApiError as e:
            return self._bad(e.message)

    async def _engine_op(self, request: web.Request, op) -> web.Response:
        self._admin(request)
        eid = request.match_info["id"]
        try:
            result = await op(eid)
        except RoutingError as e:
            return self._bad(str(e), 404)
        return _json({"engine_id": eid, "result": result, "engines": self.pool.describe()})

    async def remove_engine(self, request: web.Request) -> web.Response:
        return await self._engine_op(request, self.pool.remove)

    async def drain_engine(self, request: web.Request) -> web.Response:
        return await self._engine_op(request, self.pool.hand_off)

    async def activate_engine(self, request: web.Request) -> web.Response:
        return await self._engine_op(request, self.pool.activate)

    async def engine_weight_version(self, request: web.Request) -> web.Response:
        self._admin(request)
        body = await request.json()
        body = body if isinstance(body, dict) else {}
        loading, version = body.get("loading"), body.get("weight_version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            return self._bad(f"weight_version must be an integer >= 0, got {version!r}")
        if (version is None) == (loading is None) or loading not in (None, True, False):
            return self._bad("give one of weight_version (an integer >= 0), loading: true, loading: false")
        return await self._engine_op(request, lambda eid: self.pool.set_weight_version(eid, version, loading is True))

    async def stop_admission(self, request: web.Request) -> web.Response:
        return await self._engine_op(request, self.pool.stop_admission)

    async def metrics(self, request: web.Request) -> web.Response:
        """Counters, engines (status, calls in flight, sessions) and executions (calls in flight,
        whether a session of theirs is in the routing table): O(engines + sessions + executions)."""
        self._admin(request)
        with_sessions = self.pool.executions_with_sessions()
        executions = {
            eid: {"num_inflight": ex.num_inflight, "has_session": eid in with_sessions}
            for eid, ex in self.executions.by_id.items()
            if not ex.revoked
        }
        return _json(
            {
                **vars(self.pool.metrics),
                "worker_index": self.cfg.worker_index,
                "num_executions": len(self.executions.by_id),
                "engines": self.pool.describe(),
                "executions": executions,
            }
        )
