"""The SGLang contract fake: SGLang 0.5.21's HTTP server as Gyre calls it, on CPU, for tests where
SGLang cannot run (no GPU). It computes with the builtin engine's model code (EngineCore) and
behaves as SGLang does where Gyre depends on it, each behaviour read from the sglang 0.5.21 wheel
(sgl-project/sglang, `python/sglang/srt/...`; paths below are under `srt/`):

    /generate              holds the model-update read lock for its lifetime, after waiting while
                           generation is paused (managers/tokenizer_manager.py `generate_request`);
                           meta_info has `weight_version` (the server's, a string) and, on the final
                           answer, `weight_versions` [{version, start, end}] (utils/weight_versions.py
                           `add_weight_versions_to_meta_info`); no Gyre `weight_version_spans`. A
                           refused call: 400 {"error": {"message"}}, or, streamed, HTTP 200 with
                           `data: {"error": {message, type, code, retryable}}` then `data: [DONE]`
                           (entrypoints/http_server.py `generate_request`)
    /abort_request         200, empty body; a rid that is no live request is dropped, a live one aborts
                           every request whose rid starts with it (tokenizer_manager.py
                           `abort_request`, managers/scheduler.py `abort_request`)
    /pause_generation      {mode: abort | retract | in_place}: new calls wait; abort aborts every call
                           and returns once none holds the read lock; retract puts running calls back
                           in the queue without their KV (recomputed on continue, under the weights
                           then served); in_place keeps them and their KV (scheduler.py
                           `pause_generation`); /continue_generation {torch_empty_cache} resumes
    /begin_weight_update, /end_weight_update   the session that /update_weights_from_distributed and
                           /update_weights_from_tensor must run in, else 400 (scheduler_components/
                           weight_updater.py)
    /update_weights_from_distributed | _from_tensor | _from_disk, begin/end   take the write lock
                           unless paused (managers/tokenizer_control_mixin.py, tokenizer_manager.py
                           `update_weights_from_disk`): not paused, an update waits for every call in
                           flight and every new call waits for it; `flush_cache` (default true) with
                           calls still running (an in_place pause) fails SGLang's assertion and the
                           server dies (weight_updater.py `flush_cache_after_weight_update`)
    /release_memory_occupation   asserts the server is idle (running calls, or queued ones unless
                           paused by retract or in_place): otherwise the scheduler's AssertionError
                           kills the server (weight_updater.py, scheduler.py `run_scheduler_process`)
    /health, /health_generate   a one-token generation through the same gate and lock; 200 once the
                           engine produced anything (checked each second), 503 after
                           SGLANG_HEALTH_CHECK_TIMEOUT (20 s): slow during a load, failing while
                           paused or released. `/health` answers 200 at once with
                           SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 (environ.py, http_server.py)
    /ready                 200 unless paused (tokenizer_manager.py `is_ready`)
    /get_model_info, /model_info   http_server.py `model_info`'s fields: no page size, no capacity
    /init_weights_update_group   {"success", "message"}, 400 when it fails
    /flush_cache           text, 200 or 400 while requests run
    HiCache's L3 store     with --enable-hierarchical-cache --hicache-storage-backend mooncake and
                           GYRE_SGLANG_FAKE_L3_DIR (the fake's stand-in for the Mooncake store its
                           servers share): a call's pages are written through when it ends, and a
                           call's prompt pages found there count in its `cached_tokens`
                           (mem_cache/hicache_storage.py, mem_cache/utils.py; keys seeded by `extra_key`)
    /v1/loads              {loads: [{dp_rank, num_running_reqs, num_waiting_reqs, ...}]}
                           (`python/sglang/srt/entrypoints/v1_loads.py`'s fields Gyre reads)
    anything else (Gyre's /gyre/* KV routes among them)   404 {"detail": "Not Found"} (FastAPI's)

It takes `sglang.launch_server`'s command line (gyre.engines.launch.make_sglang_command), so a run
with `engine.sglang_fake=true` starts it exactly as it would start SGLang. With
GYRE_SGLANG_FAKE_AUDIT=FILE it appends {rid, extra_key, weight_version} per /generate as received
(what the engine served then), {pause: mode} per pause and {exclusive, paused} per update call.

    python -m gyre.engines.sglang_fake --model-path DIR --port N [sglang.launch_server flags]
"""

import argparse
import asyncio
import os
import uuid

import torch
from aiohttp import web

from gyre.common import jsonio
from gyre.common.serve import serve_app
from gyre.common.weight_group import join_weight_group
from gyre.engines.config import EngineConfig
from gyre.engines.core import PAUSE_MODES, EngineRequestError, Request
from gyre.engines.protocol import BadRequest, parse_generate
from gyre.engines.server import BuiltinEngineServer, _json
from gyre.engines.sglang_fake_parts import (
    HEALTH_CHECK_RID_PREFIX,
    L3Store,
    PauseGate,
    RWLock,
    env_bool,
    label_spans,
    reply,
    scheduler_crash,
    stream_error,
)
from gyre.models.checkpoint import load_checkpoint
from gyre.models.config import ModelConfig
from gyre.models.hf import engine_name, read_hf_config

_SUCCESS_SHAPED = (
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/begin_weight_update",
    "/end_weight_update",
)


@web.middleware
async def _sglang_errors(request: web.Request, handler):
    """SGLang's error shapes: weight routes {"success": false, "message"}, the rest {"error": {"message"}}."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except (BadRequest, EngineRequestError, KeyError, TypeError, ValueError) as e:
        if request.path in _SUCCESS_SHAPED:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        return web.json_response({"error": {"message": str(e)}}, status=400)


class SGLangFakeServer(BuiltinEngineServer):
    """The builtin engine's core behind SGLang's routes, answers and waits (see the module docstring)."""

    def __init__(self, engine_cfg: EngineConfig, model_cfg: ModelConfig, model_path: str, args: argparse.Namespace):
        super().__init__(engine_cfg, model_cfg)
        self.served_path, self.version_label, self.load_format = model_path, args.weight_version, args.load_format
        self.labels = {self.core.weight_version: self.version_label}
        """The core's integer version -> the label the update carried (SGLang versions are strings)."""
        self.groups: dict[str, torch.distributed.ProcessGroup] = {}
        self.audit = os.environ.get("GYRE_SGLANG_FAKE_AUDIT", "").replace("{port}", str(engine_cfg.port))  # per engine
        self.lock, self.gate = RWLock(), PauseGate()
        self.scheduler_paused = False
        """The scheduler's `_engine_paused`: set by retract and in_place pauses, not by abort."""
        self.session_open = False
        self.live_rids: set[str] = set()
        self.health_generates = env_bool("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", True)
        self.health_timeout_s = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
        l3_dir = os.environ.get("GYRE_SGLANG_FAKE_L3_DIR")
        hicache = args.enable_hierarchical_cache and args.hicache_storage_backend == "mooncake"
        self.l3 = L3Store(l3_dir, engine_cfg.page_size) if hicache and l3_dir else None
        self.l3_calls: dict[str, tuple[list[int], str | None]] = {}
        """rid -> (input_ids, extra_key) of the calls whose pages are written through when they end."""

    def app(self) -> web.Application:
        return self.make_app([_sglang_errors], self.routes())  # SGLang's routes only: no gyre_routes

    def routes(self) -> list[web.RouteDef]:
        post, get = web.post, web.get
        return super().routes() + [
            post("/begin_weight_update", self.begin_weight_update),
            post("/end_weight_update", self.end_weight_update),
            get("/ready", self.ready),
            get("/model_info", self.model_info),
        ]

    def answer(self, snap: dict) -> dict:
        meta = {k: v for k, v in snap["meta_info"].items() if k != "weight_version_spans"}
        meta["weight_version"] = self.version_label
        if meta.get("finish_reason"):
            spans = label_spans(snap["meta_info"]["weight_version_spans"], self.labels, self.version_label)
            meta |= {"weight_versions": spans, "weight_version": spans[-1]["version"]}
            self._write_through(meta["id"], snap["output_ids"])
        return {**snap, "meta_info": meta}

    def _write_through(self, rid: str, output_ids: list[int]) -> None:
        """A call ended (engine thread; its KV is in the prefix cache now): its pages go to L3
        (`--hicache-write-policy write_through`), for any server of the store to read."""
        ids, extra_key = self.l3_calls.pop(rid, (None, None))
        if ids is not None:
            tokens = ids + output_ids
            n, pages, _ = self.core.export_kv(tokens, extra_key)
            if n:
                self.l3.save(tokens[:n], torch.cat(pages, dim=2), extra_key)

    def _prefetch(self, body: dict) -> None:
        """Before a call runs: the pages of its prompt that L3 holds beyond the local cache come into
        it, so they count in its `cached_tokens` as HiCache's storage hits do."""
        ids, extra_key = body.get("input_ids"), body.get("extra_key")
        if not isinstance(ids, list) or not ids or not isinstance(body.get("rid"), str):
            return
        extra_key = None if extra_key is None else str(extra_key)
        self.l3_calls[body["rid"]] = (list(ids), extra_key)
        local = self.core.export_kv(ids[:-1], extra_key)[0]
        n, kv = self.l3.load(ids[:-1], extra_key)
        if n > local:
            try:
                self.core.import_kv(ids[:n], kv, self.core.weight_version, extra_key)
            except EngineRequestError:  # no room, or memory released: the call computes them
                pass

    def _idle(self) -> bool:
        """The scheduler's `is_fully_idle(ignore_waiting=_engine_paused)` (engine thread)."""
        loads = self.core.loads()
        return loads["num_running_reqs"] == 0 and (self.scheduler_paused or loads["num_waiting_reqs"] == 0)

    # --- generation ---------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        self._audit({"rid": body.get("rid"), "extra_key": body.get("extra_key"), "weight_version": self.version_label})
        rid = body.get("rid") if isinstance(body.get("rid"), str) else None
        if rid:
            self.live_rids.add(rid)
        try:
            await self.gate.wait_unpaused()
            async with self.lock.reader():
                if self.l3 is not None:
                    await asyncio.to_thread(self._prefetch, body)
                try:
                    return await self.serve_generate(request, body)
                except BadRequest as e:
                    if not body.get("stream"):
                        raise
                    return await stream_error(request, str(e))
        finally:
            self.live_rids.discard(rid)
            self.l3_calls.pop(rid, None)  # written through at its end, or refused

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json(request)
        rid, abort_all = str(body.get("rid") or ""), bool(body.get("abort_all", False))
        if abort_all or rid in self.live_rids:  # the tokenizer manager drops a rid it does not know
            await self._call(lambda: self.core.abort(rid, abort_all, prefix=True))
        return web.Response(status=200)

    async def pause(self, request: web.Request) -> web.Response:
        mode = (await _json(request)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode {mode!r} is not one of {list(PAUSE_MODES)}")
        self._audit({"pause": mode})
        async with self.gate.cond:
            self.gate.is_pause = True
            if mode != "abort":
                await self._call(lambda: self.core.pause(mode))
                self.scheduler_paused = True
            else:  # abort until no call holds the read lock (upstream re-checks each second)
                while True:
                    await self._call(lambda: self.core.abort(abort_all=True))
                    if not self.lock.locked:
                        break
                    await self.lock.wait_unlocked(1.0)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await _json(request)  # {torch_empty_cache}: nothing to empty on CPU
        async with self.gate.cond:
            self.gate.is_pause = False
            await self._call(self.core.resume)
            self.scheduler_paused = False
            self.gate.cond.notify_all()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    def _audit(self, line: dict) -> None:
        if self.audit:
            with open(self.audit, "a") as f:
                f.write(jsonio.dumps(line) + "\n")

    # --- weights ------------------------------------------------------------------------------
    async def _exclusive(self, route: str, fn, hold_pause: bool = True) -> web.Response:
        """Run `fn` as SGLang runs an update: at once when paused (holding the pause condition, so
        nobody continues meanwhile, except from disk), else under the write lock."""
        async with self.gate.cond:
            paused = self.gate.is_pause
            self._audit({"exclusive": route, "paused": paused})
            if paused and hold_pause:
                return await fn()
        if paused:
            return await fn()
        async with self.lock.writer():
            return await fn()

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        await _json(request)

        async def begin() -> web.Response:
            if self.session_open:
                return reply(False, "a weight-update session is already open; call end_weight_update() first")
            self.session_open = True
            return reply(True, "Success")

        return await self._exclusive("begin_weight_update", begin)

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await _json(request)

        async def end() -> web.Response:
            if not self.session_open:
                return reply(False, "no weight-update session is open; call begin_weight_update() first")
            self.session_open = False
            return reply(True, "Success")

        return await self._exclusive("end_weight_update", end)

    def _no_session(self, route: str) -> web.Response | None:
        if self.session_open:
            return None
        return reply(False, f"{route} must run between begin_weight_update() and end_weight_update()")

    async def _load(self, body: dict, weights: dict[str, torch.Tensor], message: str, **extra) -> web.Response:
        version, flush = body.get("weight_version"), bool(body.get("flush_cache", True))
        label = self.version_label if version is None else str(version)
        new = self.core.weight_version + 1
        self.labels[new] = label

        def update() -> bool:
            idle = self._idle()
            self.core.update_weights(weights, new, flush and idle)
            return idle or not flush

        if not await self._call(update):
            scheduler_crash("Cache flush failed after updating weights")
        self.version_label = label
        if version is not None:
            message += f" Weight version updated to {version}."
        return reply(True, message, **extra)

    async def init_group(self, request: web.Request) -> web.Response:
        body = await _json(request)
        name = body.get("group_name", "weight_update_group")
        args = (body["master_address"], int(body["master_port"]), int(body["rank_offset"]), int(body["world_size"]))
        try:
            self.groups[name] = await asyncio.to_thread(join_weight_group, *args, name, body.get("backend", "nccl"))
        except (RuntimeError, ValueError) as e:
            return reply(False, f"Failed to initialize custom process group: {e}.")
        return reply(True, "Succeeded to initialize custom process group.")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if body.get("abort_all_requests"):
            await self._call(lambda: self.core.abort(abort_all=True))
        return await self._exclusive("update_weights_from_distributed", lambda: self._receive(body))

    async def _receive(self, body: dict) -> web.Response:
        """One broadcast per announced tensor from rank 0 of the weight group, then the load."""
        refused = self._no_session("update_weights_from_distributed")
        if refused is not None:
            return refused
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            return reply(
                False, f"Group {name} not in {list(self.groups)}. Please call `init_weights_update_group` first."
            )
        shapes = zip(body["names"], body["dtypes"], body["shapes"], strict=True)
        received = {n: torch.empty(s, dtype=getattr(torch, d)) for n, d, s in shapes}

        def receive() -> None:
            group = self.groups[name]
            for work in [torch.distributed.broadcast(t, src=0, group=group, async_op=True) for t in received.values()]:
                work.wait()

        await asyncio.to_thread(receive)
        weights = {engine_name(n): t.to(torch.float32) for n, t in received.items()}
        return await self._load(body, weights, "Succeeded to update parameter online.")

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if body.get("abort_all_requests"):
            await self._call(lambda: self.core.abort(abort_all=True))

        async def load() -> web.Response:
            path = body["model_path"]
            cfg, weights = await asyncio.to_thread(load_checkpoint, path)
            if not cfg.same_architecture(self.model_cfg):
                raise ValueError(f"{path}/config.json describes a different architecture than the served model")
            response = await self._load(body, weights, "Succeeded to update model weights.", num_paused_requests=0)
            self._source = path
            return response

        return await self._exclusive("update_weights_from_disk", load, hold_pause=False)

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if "serialized_named_tensors" not in body:  # FastAPI's validation error, 400 (SGLang's handler)
            msg = "1 validation error: serialized_named_tensors Field required"
            return web.json_response(
                {"object": "error", "message": msg, "type": "Bad Request", "param": None, "code": 400}, status=400
            )
        if body.get("abort_all_requests"):
            await self._call(lambda: self.core.abort(abort_all=True))

        async def load() -> web.Response:
            refused = self._no_session("update_weights_from_tensor")
            fmt = body.get("load_format")
            if refused is None and fmt not in (None, "direct", "flattened_bucket"):
                refused = reply(False, f"Unknown load_format={fmt}")
            msg = "sglang_fake: SGLang's pickled (MultiprocessingSerializer) tensors cannot be read here"
            return refused if refused is not None else reply(False, msg)

        return await self._exclusive("update_weights_from_tensor", load)

    # --- memory, cache, status ----------------------------------------------------------------
    async def flush_cache(self, request: web.Request) -> web.Response:
        text = (
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )
        try:
            await self._call(self.core.flush_cache)
        except EngineRequestError:
            return web.Response(text=text, status=400)
        return web.Response(text=text)

    async def release_memory(self, request: web.Request) -> web.Response:
        if not await self._call(self._idle):
            scheduler_crash("release_memory_occupation should be called only when server is idle.")
        await super().release_memory(request)
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        await super().resume_memory(request)
        return web.json_response(None)

    async def health(self, request: web.Request) -> web.Response:
        if request.path == "/health" and not self.health_generates:
            return web.Response(status=200)
        loop = asyncio.get_running_loop()
        steps, deadline = self.core.num_steps, loop.time() + self.health_timeout_s
        probe = asyncio.create_task(self._health_probe())
        try:
            while loop.time() < deadline:
                await asyncio.sleep(1.0)  # http_server.py `health_generate` looks once a second
                if self.core.num_steps > steps:  # anything the engine produced since (busy or the probe)
                    return web.Response(status=200)
            return web.Response(status=503)
        finally:
            probe.cancel()

    health_generate = health

    async def _health_probe(self) -> None:
        """The one-token generation of /health, through the pause gate and the read lock."""
        await self.gate.wait_unpaused()
        async with self.lock.reader():
            loop, done = asyncio.get_running_loop(), asyncio.Event()
            rid = f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"
            params = parse_generate({"input_ids": [0], "sampling_params": {"max_new_tokens": 1}}, 1, 2).params
            self.core.submit(Request(rid, [0], params, lambda _r, final: final and loop.call_soon_threadsafe(done.set)))
            try:
                await done.wait()
            except asyncio.CancelledError:
                self.core.call(lambda: self.core.abort(rid))
                raise

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.gate.is_pause else 200)

    async def model_info(self, request: web.Request) -> web.Response:
        hf = {}
        if os.path.exists(os.path.join(self.served_path, "config.json")):
            with open(os.path.join(self.served_path, "config.json"), "rb") as f:
                hf = jsonio.loads(f.read())
        return web.json_response(
            {
                "model_path": self.served_path,
                "served_model_name": self.served_path,
                "tokenizer_path": self.served_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.version_label,
                "load_format": self.load_format,
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": hf.get("model_type"),
                "architectures": hf.get("architectures"),
            }
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The `sglang.launch_server` flags Gyre passes (gyre.engines.launch.make_sglang_command); others
    fail as SGLang's parser fails on unknown flags."""
    p = argparse.ArgumentParser(prog="gyre.engines.sglang_fake", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    for flag, default in (("--tp-size", 1), ("--base-gpu-id", 0), ("--nnodes", 1), ("--node-rank", 0)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--weight-version", default="default")
    for flag in ("--enable-memory-saver", "--enable-hierarchical-cache"):
        p.add_argument(flag, action="store_true")
    for flag in ("--mem-fraction-static", "--hicache-ratio"):
        p.add_argument(flag, type=float)
    for flag in ("--hicache-write-policy", "--hicache-storage-backend", "--dist-init-addr"):
        p.add_argument(flag)
    a = p.parse_args(argv)
    if a.tp_size != 1 or a.nnodes != 1:
        p.error(f"--tp-size {a.tp_size} --nnodes {a.nnodes}: the contract fake serves one rank (engine.tp_size=1)")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    version = int(a.weight_version) if a.weight_version.isdigit() else 0
    cfg = EngineConfig(bind_host=a.host, port=a.port, page_size=a.page_size, weight_version=version)
    if a.load_format == "dummy":  # SGLang's random weights of the directory's architecture
        model_cfg = ModelConfig(name=os.path.basename(a.model_path), **read_hf_config(a.model_path))
    else:
        model_cfg = ModelConfig(path=a.model_path)
    server = SGLangFakeServer(cfg, model_cfg, a.model_path, a)
    serve_app(server.app(), a.host, a.port, "sglang-fake")


if __name__ == "__main__":
    main()
