"""`gyre-engine`'s HTTP edge: the SGLang contract served by aiohttp over an EngineCore.

Handlers parse and validate (gyre.engines.protocol), then hand work to the engine thread (submit
for generations, call() for control). Errors the engine refuses come back as 400 with a JSON
`{"error": {"message": ...}}` body; the server stays up. KV export/import (`/gyre/*`) moves pages
over the Mooncake Transfer Engine.
"""

import argparse
import asyncio
import base64
import ctypes
import dataclasses
import gc
import os
import shutil
import sys
import tempfile
import time

import torch
from aiohttp import web
from safetensors.torch import load as load_safetensors

from gyre.common import jsonio
from gyre.common.files import read_child_config
from gyre.common.serve import serve_app
from gyre.common.sse import open_stream, send_events
from gyre.engines.config import EngineConfig
from gyre.engines.core import EngineCore, EngineRequestError, Request
from gyre.engines.kv_transfer import KVExporter, import_sessions
from gyre.engines.protocol import BadRequest, int_list, make_response, parse_generate
from gyre.engines.scripted import ScriptedPolicy
from gyre.errors import GyreError
from gyre.models.checkpoint import load_checkpoint, save_checkpoint
from gyre.models.config import ModelConfig
from gyre.models.tokenizer import (
    SPECIAL_TOKENS,
    ByteTokenizer,
    HFTokenizer,
    has_bpe_tokenizer,
    has_hf_tokenizer,
    load_tokenizer,
)
from gyre.models.transformer import init_weights
from gyre.records.versions import WeightVersionError, parse_weight_version


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}, "success": False, "message": message}, status=status)


async def _json(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    try:
        body = jsonio.loads(await request.read())  # a 131K-token prompt: ~5x faster than json
    except jsonio.DecodeError as e:
        raise BadRequest(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


@web.middleware
async def _errors_to_400(request: web.Request, handler):
    try:
        return await handler(request)
    except (BadRequest, EngineRequestError, WeightVersionError) as e:
        return _error(400, str(e))


class BuiltinEngineServer:
    """Owns the EngineCore, the weight source (for resume after release), and the KV exporter."""

    def __init__(self, engine_cfg: EngineConfig, model_cfg: ModelConfig):
        self.cfg = engine_cfg
        path = engine_cfg.model_path or model_cfg.path  # the engine's own directory, else the model's
        if path:
            model_cfg, weights = load_checkpoint(path)
            self._source = path
        else:
            weights = init_weights(model_cfg, engine_cfg.init_seed)
            self._source = None
        self.model_cfg = model_cfg
        self.model_path = path
        if path and (has_hf_tokenizer(path) or has_bpe_tokenizer(path)):
            self.tokenizer = load_tokenizer(path, model_cfg.vocab_size)
        else:
            ok = model_cfg.vocab_size >= 256 + len(SPECIAL_TOKENS)
            self.tokenizer = ByteTokenizer(model_cfg.vocab_size) if ok else None
        self.exporter = KVExporter(engine_cfg.kv_arena_mib << 20)
        self.core = EngineCore(
            model_cfg,
            weights,
            engine_cfg.weight_version,
            max_running_requests=engine_cfg.max_running_requests,
            max_prefill_tokens=engine_cfg.max_prefill_tokens,
            page_size=engine_cfg.page_size,
            prefix_cache_tokens=engine_cfg.prefix_cache_tokens,
            allocate_kv=self.exporter.allocate,
        )
        self.policy = None
        if engine_cfg.scripted_policy:
            if self.tokenizer is None:
                raise GyreError("a scripted policy needs the byte tokenizer (vocab_size >= 265)")
            self.policy = ScriptedPolicy.from_file(engine_cfg.scripted_policy, self.tokenizer)
        self._scratch = tempfile.mkdtemp(prefix="gyre-engine-")

    def app(self) -> web.Application:
        return self.make_app([_errors_to_400], self.routes() + self.gyre_routes())

    def make_app(self, middlewares: list, routes: list[web.RouteDef]) -> web.Application:
        app = web.Application(middlewares=middlewares, client_max_size=1 << 30)
        app.add_routes(routes)
        app.on_startup.append(lambda _app: self._start())
        app.on_cleanup.append(lambda _app: self._close())
        return app

    def routes(self) -> list[web.RouteDef]:
        """SGLang's routes, those Gyre calls (the contract), each to the method of its name."""
        post, get = web.post, web.get
        return [
            post("/generate", self.generate),
            post("/abort_request", self.abort_request),
            post("/pause_generation", self.pause),
            post("/continue_generation", self.continue_generation),
            post("/update_weights_from_disk", self.update_from_disk),
            post("/update_weights_from_tensor", self.update_from_tensor),
            post("/update_weights_from_distributed", self.update_from_distributed),
            post("/init_weights_update_group", self.init_group),
            post("/flush_cache", self.flush_cache),
            get("/flush_cache", self.flush_cache),
            post("/release_memory_occupation", self.release_memory),
            post("/resume_memory_occupation", self.resume_memory),
            get("/health", self.health),
            get("/health_generate", self.health_generate),
            get("/get_model_info", self.model_info),
            get("/v1/loads", self.loads),
        ]

    def gyre_routes(self) -> list[web.RouteDef]:
        """The builtin engine's own: KV export/import over Mooncake, and a status alias."""
        post, get = web.post, web.get
        return [
            get("/model_info", self.model_info),
            post("/gyre/export_kv", self.export_kv),
            post("/gyre/release_kv_export", self.release_kv_export),
            post("/gyre/import_kv", self.import_kv),
        ]

    async def _start(self) -> None:
        self.core.start()
        if self.cfg.kv_arena_mib:
            await asyncio.to_thread(self.exporter.open)  # memory touched, endpoint opened: not in a hand-off

    async def _close(self) -> None:
        await asyncio.to_thread(self.core.stop)
        self.exporter.close()
        shutil.rmtree(self._scratch, ignore_errors=True)

    async def _call(self, fn):
        return await asyncio.wrap_future(self.core.call(fn))

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    # --- generation ---------------------------------------------------------------------------
    def answer(self, snap: dict) -> dict:
        """A /generate answer as this server's contract shapes it (the SGLang fake drops Gyre's fields)."""
        return snap

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self.serve_generate(request, await _json(request))

    async def serve_generate(self, request: web.Request, body: dict) -> web.StreamResponse:
        """Answer the /generate `body` (read off `request`, which the answer is written to)."""
        g = parse_generate(
            body,
            self.model_cfg.vocab_size,
            self.model_cfg.max_seq_len,
            self.tokenizer.encode if self.tokenizer else None,
        )
        loop, queue, t0 = asyncio.get_running_loop(), asyncio.Queue(), time.monotonic()

        def emit(req: Request, final: bool) -> None:  # engine thread: snapshot, then hand over
            if final or g.stream:
                snap = self.answer(
                    make_response(
                        req,
                        self._text(req.output_ids),
                        self.core.weight_version,
                        g.return_logprob,
                        time.monotonic() - t0,
                    )
                )
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, (snap, final))
                except RuntimeError:  # the server's loop is closed: shutting down, nobody to tell
                    pass

        forced = self.policy.forced_ids(g.input_ids) if self.policy else None
        self.core.submit(Request(g.rid, g.input_ids, g.params, emit, extra_key=g.extra_key, forced=forced))
        try:
            if not g.stream:
                while True:
                    snap, final = await queue.get()
                    if final:
                        return web.json_response(snap)
            async with open_stream(request) as sse:
                final = False
                while not final:
                    snap, final = await queue.get()
                    await send_events(sse, [(None, snap)])
                await send_events(sse, [(None, "[DONE]")])
            return sse
        except (asyncio.CancelledError, ConnectionResetError):
            self.core.call(lambda: self.core.abort(g.rid))  # the client went away: free its slot
            raise

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json(request)
        n = await self._call(lambda: self.core.abort(body.get("rid"), bool(body.get("abort_all", False))))
        return web.json_response({"success": True, "num_aborted": n})

    async def pause(self, request: web.Request) -> web.Response:
        mode = (await _json(request)).get("mode", "abort")
        await self._call(lambda: self.core.pause(mode))
        return web.json_response({"success": True, "mode": mode})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._call(self.core.resume)
        return web.json_response({"success": True})

    # --- weights ------------------------------------------------------------------------------
    async def _apply_weights(self, body: dict, weights: dict) -> web.Response:
        version = body.get("weight_version")
        if body.get("abort_all_requests"):
            await self._call(lambda: self.core.abort(abort_all=True))
        flush = bool(body.get("flush_cache", True))
        version = None if version is None else parse_weight_version(version)
        new = await self._call(lambda: self.core.update_weights(weights, version, flush))
        return web.json_response({"success": True, "message": "weights updated", "weight_version": new})

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await _json(request)
        path = body.get("model_path")
        if not isinstance(path, str):
            raise BadRequest("missing model_path (a directory with config.json and model.safetensors)")
        try:
            cfg, weights = await asyncio.to_thread(load_checkpoint, path)
        except (OSError, ValueError) as e:
            raise BadRequest(f"cannot load {path}: {e}") from None
        if not cfg.same_architecture(self.model_cfg):
            raise BadRequest(f"{path}/config.json describes a different architecture than the served model")
        response = await self._apply_weights(body, weights)
        self._source = path
        return response

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        """`load_format` "gyre_transfer" reads a packed buffer from a peer over Mooncake
        ({session_id, address, layout}); otherwise `serialized_named_tensors` is a list of
        base64-encoded safetensors blobs (SGLang's pickled tensors are not accepted)."""
        body = await _json(request)
        try:
            if body.get("load_format") == "gyre_transfer":
                weights = await asyncio.to_thread(self.exporter.endpoint.fetch_tensors, body)
            else:
                blobs = body.get("serialized_named_tensors")
                if not isinstance(blobs, list) or not blobs:
                    raise BadRequest(
                        "missing serialized_named_tensors (base64 safetensors) or load_format=gyre_transfer"
                    )
                weights = {}
                for b in blobs:
                    weights.update({k: v.clone() for k, v in load_safetensors(base64.b64decode(b)).items()})
        except (KeyError, TypeError, ValueError, GyreError) as e:
            raise BadRequest(f"bad weight payload: {e!r}") from None
        response = await self._apply_weights(body, weights)
        self._source = None  # only in memory now: release() will spill to scratch
        return response

    async def init_group(self, request: web.Request) -> web.Response:
        return self._unsupported(request)

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        return self._unsupported(request)

    @staticmethod
    def _unsupported(request: web.Request) -> web.Response:
        return _error(
            400,
            f"{request.path} needs NCCL and is SGLang-only; the builtin engine takes "
            "/update_weights_from_tensor with load_format=gyre_transfer (Mooncake)",
        )

    # --- memory and cache ---------------------------------------------------------------------
    async def flush_cache(self, request: web.Request) -> web.Response:
        await self._call(self.core.flush_cache)
        return web.json_response({"success": True, "message": "cache flushed"})

    async def release_memory(self, request: web.Request) -> web.Response:
        tags = (await _json(request)).get("tags") or ["weights", "kv_cache"]
        # Released weights come back from disk on resume: spill in-memory ones to scratch first.
        if "weights" in tags and self._source is None and self.core.weights is not None:
            spill = os.path.join(self._scratch, "released")
            await asyncio.to_thread(save_checkpoint, spill, self.model_cfg, self.core.weights)
            self._source = spill
        await self._call(lambda: self.core.release_memory(list(tags)))
        return web.json_response({"success": True})

    async def resume_memory(self, request: web.Request) -> web.Response:
        tags = (await _json(request)).get("tags") or ["weights", "kv_cache"]
        weights = None
        if "weights" in tags and "weights" in self.core.released:
            weights = (await asyncio.to_thread(load_checkpoint, self._source))[1]
        await self._call(lambda: self.core.resume_memory(list(tags), weights))
        return web.json_response({"success": True})

    # --- status -------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK") if self.core.alive else _error(503, "engine thread is not running")

    async def health_generate(self, request: web.Request) -> web.Response:
        if self.core.paused or self.core.released:
            return _error(503, "generation is paused or memory is released")
        loop, done = asyncio.get_running_loop(), asyncio.Event()
        req = Request(
            "health-" + os.urandom(4).hex(),
            [0],
            parse_generate({"input_ids": [0], "sampling_params": {"max_new_tokens": 1}}, 1, 2).params,
            lambda _r, final: final and loop.call_soon_threadsafe(done.set),
        )
        self.core.submit(req)
        try:
            await asyncio.wait_for(done.wait(), timeout=20)
        except TimeoutError:
            self.core.call(lambda: self.core.abort(req.rid))
            return _error(503, "a 1-token generation did not finish within 20 s")
        return web.Response(text="OK")

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path if isinstance(self.tokenizer, HFTokenizer) else None,
                "is_generation": True,
                "weight_version": self.core.weight_version,
                "context_length": self.model_cfg.max_seq_len,
                "vocab_size": self.model_cfg.vocab_size,
                "engine": "gyre-builtin",
                "page_size": self.core.cache.page_size,
                "max_total_num_tokens": self.core.cache.capacity_pages * self.core.cache.page_size,
                "model_config": dataclasses.asdict(self.model_cfg),
            }
        )

    async def loads(self, request: web.Request) -> web.Response:
        return web.json_response({"loads": [{"dp_rank": 0, **self.core.loads()}]})

    # --- KV export/import (Gyre extension) ----------------------------------------------------
    async def export_kv(self, request: web.Request) -> web.Response:
        """Publish the cached KV of sessions' prefixes (`{sessions: [{input_ids, kv_from}],
        extra_key}`), one descriptor for all (kv_transfer)."""
        body = await _json(request)
        try:
            # Only a lookup key: ids outside the vocabulary match no page (a type check, not
            # parse_generate's, which costs ~1 ms a 16K-token session on a hand-off's clock).
            asks = [(int_list(s["input_ids"], "input_ids"), int(s.get("kv_from", 0))) for s in body["sessions"]]
        except (KeyError, TypeError, ValueError) as e:
            raise BadRequest(f"bad export_kv body: missing or malformed {e}") from None
        extra_key = body.get("extra_key")

        def export() -> dict:  # off the event loop and beside the engine thread: no step wait
            found = [(ids, self.core.export_kv(ids, extra_key)) for ids, _ in asks]
            sessions = [(ids[:n], pages, min(kv_from, n)) for (ids, (n, pages, _)), (_, kv_from) in zip(found, asks)]
            version = found[0][1][2] if found else self.core.weight_version
            return {**self.exporter.export(sessions), "weight_version": version}

        return web.json_response(await asyncio.to_thread(export))

    async def release_kv_export(self, request: web.Request) -> web.Response:
        self.exporter.release(str((await _json(request)).get("export_id")))
        return web.json_response({"success": True})

    async def import_kv(self, request: web.Request) -> web.Response:
        """Read every session of a peer's export with one batch read; per session
        {transferred_tokens, refused}."""
        body = await _json(request)
        try:
            sessions = await asyncio.to_thread(import_sessions, self, body)
        except (KeyError, TypeError, ValueError) as e:
            raise BadRequest(f"bad import_kv body: missing or malformed {e}") from None
        return web.json_response({"success": True, "sessions": sessions})


def _return_large_frees_to_the_os(threshold_bytes: int = 1 << 20) -> None:
    """Fix glibc's mmap threshold (M_MMAP_THRESHOLD = -3) at 1 MiB.

    A step's large temporaries (activations, attention masks) are freed at once, but glibc raises
    its threshold after each freed mmap chunk up to 32 MiB, so later ones land in the engine
    thread's heap arena, which fragments and never shrinks: RSS then grew with the prompt length
    (1.1 GB at 32K tokens, measured) though the live working set is bounded. A fixed threshold
    keeps them mmapped and returned on free. No-op where libc is not glibc.
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold_bytes)
    except (OSError, AttributeError):
        pass


def serve(engine_cfg: EngineConfig, model_cfg: ModelConfig, port_file: str | None = None) -> None:
    """Run the builtin engine until SIGINT/SIGTERM; writes the bound port to `port_file` once listening."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    _return_large_frees_to_the_os()
    server = BuiltinEngineServer(engine_cfg, model_cfg)
    # What start-up made (torch, the model) lives as long as the process: frozen, a full collection
    # no longer walks it (30-100 ms each, measured, at any moment, a hand-off's included). The
    # prefix cache adds a tracked page per 16 tokens (16K a 16 x 16K-token import): at the default
    # threshold (700) young collections run ~50 times an import; at 100,000 a few times an hour.
    gc.freeze()
    gc.set_threshold(100_000, 10, 10)

    serve_app(server.app(), engine_cfg.listen_host, engine_cfg.port, "gyre-engine", port_file=port_file)


def main(argv: list[str] | None = None) -> None:
    """`python -m gyre.engines.server --config FILE [--port-file F]` (FILE: {"engine": EngineConfig
    fields, "model": ModelConfig fields (ignored with model_path)} as JSON)."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--config", required=True, help="a JSON file (gyre.common.files.write_child_config)")
    p.add_argument("--port-file", default=None)
    a = p.parse_args(argv)
    try:
        config = read_child_config(a.config)
        engine_cfg = EngineConfig(**config.get("engine", {}))
        model_cfg = ModelConfig(**config.get("model", {}))
    except (OSError, TypeError, ValueError) as e:
        sys.exit(f"gyre-engine: invalid config: {e}")
    serve(engine_cfg, model_cfg, a.port_file)


if __name__ == "__main__":
    main()
