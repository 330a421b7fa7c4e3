"""The core's side of the one publish contract: after each step, one `PublishedWeights` per version,
in the form `engine.weight_sync` names (gyre.engines.published); engines load it with
gyre.engines.weights.load_weights.

    CoreServer.publish() ── engine-named snapshot of version v (registered for Mooncake reads)
        mooncake:    PublishedWeights(v, "mooncake", descriptor)
        disk:        <root>/version_v (HF directory, config.json + model.safetensors) -> {"path"}
        distributed: {"sender": WeightSender.url}; per engine, once: a weight group with the engine's
                     TP ranks (SGLang /init_weights_update_group); per load: broadcast each tensor
                     of the snapshot from rank 0 while the engine's /update_weights_from_distributed
                     receives them

The snapshot, not the live weights, is what every way sends, so a load may race the next step.
Engines get it in the served dtype (`served_dtype`: bf16 on CUDA, as SGLang serves the model; fp32
on CPU, where the builtin engine computes), cast as it is sent, not the trainer's fp32 masters.
The sender's threads set the trainer rank's CUDA device themselves: a thread starts on device 0.
"""

import asyncio
import contextlib
import itertools
import shutil
import threading
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from aiohttp import web

from gyre.common.ports import PortReservation
from gyre.common.weight_group import join_weight_group
from gyre.engines.client import EngineClient, EngineHTTPError
from gyre.engines.published import PublishedWeights
from gyre.models.checkpoint import save_checkpoint
from gyre.models.config import ModelConfig
from gyre.models.hf import hf_name

KEEP_DIRS = 2
"""Weight directories kept on disk (`disk`): an engine told of the previous version still finds it."""


def served_dtype(cuda: bool) -> torch.dtype:
    """The dtype engines load: bf16 on CUDA (SGLang's, and the HF checkpoints' own), fp32 on CPU."""
    return torch.bfloat16 if cuda else torch.float32


class WeightSender:
    """The core's `/send {engine_url, version}`: broadcast published `version` to that engine over its
    weight group (formed on the first send), while the engine receives through SGLang's routes.
    Serves on its own thread and event loop, so a send never blocks the leader's control loop."""

    def __init__(
        self,
        tensors_of,
        host: str,
        tp_size: int,
        backend: str | None = None,
        timeout_s: float = 600.0,
        dtype: torch.dtype | None = None,
    ):
        self._tensors_of, self.host, self.tp_size = tensors_of, host, tp_size
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout_s = timeout_s
        cuda = self.backend == "nccl"
        self.dtype = dtype or served_dtype(cuda)
        # the constructing thread's device, the trainer rank's (gyre.train.model.local_device)
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self._groups: dict[str, tuple[str, dist.ProcessGroup]] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._names = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self.url = ""
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True, name="weight-sender").start()
        ready.wait()

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.add_routes([web.post("/send", self._send)])
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, self.host, 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://{self.host}:{self._runner.addresses[0][1]}"
        ready.set()
        self._loop.run_forever()

    async def _send(self, request: web.Request) -> web.Response:
        body = await request.json()
        url, version, flush = str(body["engine_url"]), int(body["version"]), bool(body.get("flush_cache", True))
        async with self._locks[url], EngineClient(url, self.timeout_s) as engine:
            try:
                tensors = self._tensors_of(version)
            except LookupError as e:
                return web.json_response({"success": False, "message": str(e)}, status=400)
            try:
                name, group = self._groups.get(url) or await self._connect(url, engine)
                reply = await self._broadcast(engine, name, group, tensors, version, flush)
            except EngineHTTPError as e:
                self._drop(url)
                return web.json_response({"success": False, "message": str(e)}, status=e.status)
        return web.json_response(reply)

    async def _connect(self, url: str, engine: EngineClient) -> tuple[str, dist.ProcessGroup]:
        name, world = f"gyre-weights-{next(self._names)}", 1 + self.tp_size

        def join(port: int) -> dist.ProcessGroup:  # NCCL binds a communicator to the thread's current device
            self._use_device()
            return join_weight_group(self.host, port, 0, world, name, self.backend, self.timeout_s)

        with PortReservation() as port:  # the group's store (rank 0, here) binds it by number
            group, _ = await asyncio.gather(
                asyncio.to_thread(join, port),
                engine.init_weights_update_group(self.host, port, 1, world, name, self.backend),
            )
        self._groups[url] = (name, group)
        return name, group

    async def _broadcast(
        self, engine: EngineClient, name: str, group, tensors: dict, version: int, flush_cache: bool
    ) -> dict:
        """Broadcast while the engine receives. Its caller opened SGLang's weight update session
        first (gyre.engines.launch.SGLangProcess.load), so the engine takes the update at once; the
        copies and the broadcast run in a worker thread on a stream of their own, so the trainer's
        work never queues behind a transfer."""
        device = self.device

        def send() -> None:
            self._use_device()
            stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                sent = [t.to(device=device, dtype=self.dtype).contiguous() for t in tensors.values()]
                for work in [dist.broadcast(t, group=group, group_src=0, async_op=True) for t in sent]:
                    work.wait()
            if stream is not None:
                stream.synchronize()

        names = [hf_name(n) for n in tensors]
        dtypes = [str(self.dtype).removeprefix("torch.")] * len(tensors)
        shapes = [list(t.shape) for t in tensors.values()]
        _, reply = await asyncio.gather(
            asyncio.to_thread(send),
            engine.update_weights_from_distributed(
                names, dtypes, shapes, weight_version=version, group_name=name, flush_cache=flush_cache
            ),
        )
        return reply

    def _use_device(self) -> None:
        """Make the trainer rank's device current in this (worker) thread."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _drop(self, url: str) -> None:
        _, group = self._groups.pop(url, (None, None))
        if group is not None:
            dist.destroy_process_group(group)

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(stop(), self._loop)
        for url in list(self._groups):
            self._drop(url)


class WeightPublisher:
    """Publishes the core's newest weights as `PublishedWeights` in the form `sync` names.

    Args:
        core: the core's CoreServer (its `publish` snapshots a version; `published_tensors` reads one).
        sync: one of gyre.engines.published.WEIGHT_SYNCS.
        model_cfg: the served architecture (disk: the directories' config.json).
        root: where `disk` writes `version_<v>` directories.
        host: the address the distributed sender binds (engines connect to it).
        tp_size: each engine's TP ranks (the size of its weight group, less the trainer's rank 0).
        dtype: what engines load (`distributed`, `disk`); None: `served_dtype` here.
    """

    def __init__(
        self,
        core,
        sync: str,
        model_cfg: ModelConfig,
        root: str,
        host: str,
        tp_size: int = 1,
        dtype: torch.dtype | None = None,
    ):
        self.core, self.sync, self.model_cfg, self.root = core, sync, model_cfg, Path(root)
        self.dtype = dtype or served_dtype(torch.cuda.is_available())
        distributed = sync == "distributed"
        self.sender = WeightSender(core.published_tensors, host, tp_size, dtype=self.dtype) if distributed else None

    def publish(self) -> PublishedWeights:
        version, descriptor = self.core.publish()
        if self.sync == "mooncake":
            return PublishedWeights(version, "mooncake", descriptor)
        if self.sync == "distributed":
            return PublishedWeights(version, "distributed", {"sender": self.sender.url})
        path = self.root / f"version_{version:08d}"
        if not path.is_dir():
            dtype = str(self.dtype).removeprefix("torch.")
            save_checkpoint(path, self.model_cfg, self.core.published_tensors(version), dtype=dtype)
        for old in sorted(self.root.glob("version_*"))[:-KEEP_DIRS]:
            shutil.rmtree(old, ignore_errors=True)
        return PublishedWeights(version, "disk", {"path": str(path)})

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
