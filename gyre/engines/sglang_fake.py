"""The SGLang contract fake: SGLang 0.5.x's HTTP server as Gyre calls it, on CPU, for tests where
SGLang cannot run (no GPU). It computes with the builtin engine's model code (EngineCore) and answers
every route Gyre calls with SGLang's field names, status codes and error shapes, as
`python/sglang/srt/entrypoints/http_server.py` (sgl-project/sglang) serves them:

    /generate                         meta_info without Gyre's weight_version_spans; weight_version a
                                      string; a bad body -> 400 {"error": {"message"}}
    /abort_request                    200, empty body
    /pause_generation, /continue_generation   {"message": ..., "status": "ok"}
    /init_weights_update_group        {"success", "message"}, 400 when it fails
    /update_weights_from_distributed  receives one broadcast per announced tensor from rank 0 of the
                                      weight group (`model_runner.update_weights_from_distributed`)
    /update_weights_from_disk         {"success", "message", "num_paused_requests"}
    /update_weights_from_tensor       SGLang's pickled tensors only: `load_format=gyre_transfer` and
                                      bodies without serialized_named_tensors are refused as SGLang does
    /flush_cache                      text, 200 or 400 while requests run
    /release_memory_occupation, /resume_memory_occupation   200 null; 400 {"error": {"message"}}
    /health, /health_generate         200 / 503, empty bodies
    /get_model_info                   {model_path, tokenizer_path, is_generation,
                                      preferred_sampling_params, weight_version}
    /v1/loads                         {loads: [{dp_rank, num_running_reqs, num_waiting_reqs, ...}]}
                                      (`python/sglang/srt/entrypoints/v1_loads.py`'s fields Gyre reads)
    anything else (Gyre's /gyre/* KV routes among them)   404 {"detail": "Not Found"} (FastAPI's)

It takes `sglang.launch_server`'s command line (gyre.engines.launch.make_sglang_command), so a run
with `engine.sglang_fake=true` starts it exactly as it would start SGLang. With
GYRE_SGLANG_FAKE_AUDIT=FILE it appends {rid, extra_key, weight_version} per /generate as received
(what the engine served then), for tests to check the proxy's `extra_key`.

    python -m gyre.engines.sglang_fake --model-path DIR --port N [sglang.launch_server flags]
"""

import argparse
import asyncio
import json
import os

import torch
from aiohttp import web

from gyre.common.serve import serve_app
from gyre.common.weight_group import join_weight_group
from gyre.engines.config import EngineConfig
from gyre.engines.core import EngineRequestError
from gyre.engines.protocol import BadRequest
from gyre.engines.server import BuiltinEngineServer, _json
from gyre.models.checkpoint import load_checkpoint
from gyre.models.config import ModelConfig
from gyre.models.hf import engine_name, read_hf_config

_SUCCESS_SHAPED = ("/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed")


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
    """The builtin engine's core behind SGLang's routes and answers (see the module docstring)."""

    def __init__(self, engine_cfg: EngineConfig, model_cfg: ModelConfig, model_path: str, weight_version: str):
        super().__init__(engine_cfg, model_cfg)
        self.served_path, self.version_label = model_path, weight_version
        self.groups: dict[str, torch.distributed.ProcessGroup] = {}
        self.audit = os.environ.get("GYRE_SGLANG_FAKE_AUDIT")

    def app(self) -> web.Application:
        return self.make_app([_sglang_errors], self.routes())  # SGLang's routes only: no gyre_routes

    def answer(self, snap: dict) -> dict:
        meta = {k: v for k, v in snap["meta_info"].items() if k != "weight_version_spans"}
        return {**snap, "meta_info": {**meta, "weight_version": self.version_label}}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        if self.audit:
            line = {"rid": body.get("rid"), "extra_key": body.get("extra_key"), "weight_version": self.version_label}
            with open(self.audit, "a") as f:
                f.write(json.dumps(line) + "\n")
        return await self.serve_generate(request, body)

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json(request)
        await self._call(lambda: self.core.abort(body.get("rid"), bool(body.get("abort_all", False))))
        return web.Response(status=200)

    async def pause(self, request: web.Request) -> web.Response:
        mode = (await _json(request)).get("mode", "abort")
        await self._call(lambda: self.core.pause(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._call(self.core.resume)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    # --- weights ------------------------------------------------------------------------------
    async def _load(self, body: dict, weights: dict[str, torch.Tensor], message: str) -> web.Response:
        version = body.get("weight_version")
        flush = bool(body.get("flush_cache", True))
        await self._call(lambda: self.core.update_weights(weights, self.core.weight_version + 1, flush))
        if version is not None:
            self.version_label = str(version)
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message})

    async def init_group(self, request: web.Request) -> web.Response:
        body = await _json(request)
        name = body.get("group_name", "weight_update_group")
        args = (body["master_address"], int(body["master_port"]), int(body["rank_offset"]), int(body["world_size"]))
        try:
            self.groups[name] = await asyncio.to_thread(join_weight_group, *args, name, body.get("backend", "nccl"))
        except (RuntimeError, ValueError) as e:
            msg = f"Failed to initialize custom process group: {e}."
            return web.json_response({"success": False, "message": msg}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await _json(request)
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            msg = f"Group {name} not in {list(self.groups)}. Please call `init_weights_update_group` first."
            return web.json_response({"success": False, "message": msg}, status=400)
        shapes = zip(body["names"], body["dtypes"], body["shapes"], strict=True)
        received = {n: torch.empty(s, dtype=getattr(torch, d)) for n, d, s in shapes}

        def receive() -> None:
            for work in [
                torch.distributed.broadcast(t, src=0, group=self.groups[name], async_op=True) for t in received.values()
            ]:
                work.wait()

        await asyncio.to_thread(receive)
        weights = {engine_name(n): t.to(torch.float32) for n, t in received.items()}
        return await self._load(body, weights, "Succeeded to update parameter online.")

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await _json(request)
        path = body["model_path"]
        cfg, weights = await asyncio.to_thread(load_checkpoint, path)
        if not cfg.same_architecture(self.model_cfg):
            raise ValueError(f"{path}/config.json describes a different architecture than the served model")
        response = await self._load(body, weights, "Succeeded to update model weights.")
        self._source = path
        return response

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if "serialized_named_tensors" not in body:  # FastAPI's validation error, 400 (SGLang's handler)
            msg = "1 validation error: serialized_named_tensors Field required"
            return web.json_response(
                {"object": "error", "message": msg, "type": "Bad Request", "param": None, "code": 400}, status=400
            )
        fmt = body.get("load_format")
        if fmt not in (None, "direct", "flattened_bucket"):
            return web.json_response({"success": False, "message": f"Unknown load_format={fmt}"}, status=400)
        msg = "sglang_fake: SGLang's pickled (MultiprocessingSerializer) tensors cannot be read here"
        return web.json_response({"success": False, "message": msg}, status=400)

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
        await super().release_memory(request)
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        await super().resume_memory(request)
        return web.json_response(None)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.core.alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        response = await super().health_generate(request)
        return web.Response(status=response.status)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.served_path,
                "tokenizer_path": self.served_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.version_label,
            }
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The `sglang.launch_server` flags Gyre passes (gyre.engines.launch.make_sglang_command); others
    fail as SGLang's parser fails on unknown flags."""
    p = argparse.ArgumentParser(prog="gyre.engines.sglang_fake", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--enable-hierarchical-cache", action="store_true")
    p.add_argument("--hicache-ratio", type=float)
    p.add_argument("--hicache-write-policy")
    p.add_argument("--hicache-storage-backend")
    a = p.parse_args(argv)
    if a.tp_size != 1:
        p.error(f"--tp-size {a.tp_size}: the contract fake serves one rank (engine.tp_size=1)")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    version = int(a.weight_version) if a.weight_version.isdigit() else 0
    cfg = EngineConfig(host=a.host, port=a.port, page_size=a.page_size, weight_version=version)
    if a.load_format == "dummy":  # SGLang's random weights of the directory's architecture
        model_cfg = ModelConfig(name=os.path.basename(a.model_path), **read_hf_config(a.model_path))
    else:
        model_cfg = ModelConfig(path=a.model_path)
    server = SGLangFakeServer(cfg, model_cfg, a.model_path, a.weight_version)
    serve_app(server.app(), a.host, a.port, "sglang-fake")


if __name__ == "__main__":
    main()
