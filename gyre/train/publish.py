"""Weights to engines after a step, under engine (HF/Qwen2) names, as version `trainer.step`.

Two ways, one per engine kind:
- `push_weights`: over Mooncake. The builtin engine reads the packed buffer with one transfer
  (`/update_weights_from_tensor`, load_format `gyre_transfer`).
- `write_weights` + `load_weights_from_disk`: a model directory (model.safetensors + config.json)
  that SGLang and the builtin engine load with `/update_weights_from_disk`.
- `connect_weight_group` + `broadcast_weights` (SGLang only): the trainer's rank 0 and the SGLang
  engines form one NCCL group (`/init_weights_update_group`); each update broadcasts every tensor
  from rank 0 while the engines receive it (`/update_weights_from_distributed`).
Either way the engine bumps its `weight_version`; requests in flight continue and record the
version of each span they generated.
"""

import asyncio
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from gyre.engines.client import EngineClient
from gyre.models.checkpoint import save_checkpoint
from gyre.models.hf import hf_name
from gyre.train.trainer import Trainer
from gyre.transfer import TransferEndpoint


async def push_weights(trainer: Trainer, endpoint: TransferEndpoint, clients: list[EngineClient]) -> list[dict]:
    """Publish the trainer's current weights once and have every engine pull them over Mooncake.

    Returns:
        The engines' replies.
    Raises:
        EngineHTTPError: an engine refused or failed the update (its body says why).
    """
    descriptor, buffer = endpoint.publish_tensors(trainer.engine_weights())
    try:
        return await push_published(descriptor, trainer.step, clients)
    finally:
        endpoint.unregister(buffer)


async def push_published(descriptor: dict, version: int, clients: list[EngineClient]) -> list[dict]:
    """Have every engine pull an already published buffer (`TransferEndpoint.publish_tensors`) as `version`."""
    return await asyncio.gather(
        *(
            c.update_weights_from_tensor(weight_version=version, load_format="gyre_transfer", **descriptor)
            for c in clients
        )
    )


async def load_published(engine_url: str, weights: dict) -> dict:
    """Have the engine at `engine_url` load `weights` ({**descriptor, "version": v}, as the core
    publishes them: gyre.cells.leader) over Mooncake."""
    descriptor = dict(weights)
    version = descriptor.pop("version")
    async with EngineClient(engine_url) as client:
        return (await push_published(descriptor, version, [client]))[0]


def write_weights(trainer: Trainer, root: str | os.PathLike) -> str:
    """Write the current weights to `<root>/version_<step>` (all TP ranks gather; rank 0 writes).

    Returns:
        The model directory engines should load.
    """
    import torch.distributed as dist

    weights = trainer.engine_weights()
    path = os.path.join(root, f"version_{trainer.step:08d}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_checkpoint(path, trainer.model_cfg, weights)
    return path


async def load_weights_from_disk(clients: list[EngineClient], path: str, weight_version: int) -> list[dict]:
    """Have every engine load the model directory `path` as `weight_version`."""
    return await asyncio.gather(*(c.update_weights_from_disk(path, weight_version=weight_version) for c in clients))


WEIGHT_GROUP = "gyre"
"""Name of the trainer-to-SGLang weight group (SGLang keys the group's rendezvous under it)."""


def join_weight_group(
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str = WEIGHT_GROUP,
    backend: str = "nccl",
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Create, as its rank 0, the group SGLang engines join on /init_weights_update_group.

    SGLang's side (`sglang.srt.utils.init_custom_process_group`) rendezvouses at
    tcp://master_address:master_port, keeps the group's keys under `group_name` and builds a group
    beside the default one (the trainer's own, here); this is the same construction for rank 0,
    which hosts the store. torch has no public call for a second, separately rendezvoused group,
    hence the c10d helpers SGLang itself uses. Blocks until all `world_size` ranks have joined.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


async def connect_weight_group(
    clients: list[EngineClient],
    tp_sizes: list[int],
    master_address: str,
    master_port: int,
    group_name: str = WEIGHT_GROUP,
    backend: str = "nccl",
) -> dist.ProcessGroup:
    """Form the weight group of this process (rank 0) and the SGLang engines `clients` (engine i's
    TP ranks take the next `tp_sizes[i]` ranks). Call on the trainer's rank 0 only.

    Raises:
        EngineHTTPError: an engine could not join (its body says why).
    """
    world_size = 1 + sum(tp_sizes)
    offsets = [1 + sum(tp_sizes[:i]) for i in range(len(clients))]
    joined = asyncio.to_thread(join_weight_group, master_address, master_port, world_size, group_name, backend)
    group, *_ = await asyncio.gather(
        joined,
        *(
            c.init_weights_update_group(master_address, master_port, off, world_size, group_name, backend)
            for c, off in zip(clients, offsets)
        ),
    )
    return group


async def broadcast_weights(
    trainer: Trainer,
    group: dist.ProcessGroup | None,
    clients: list[EngineClient],
    dtype: torch.dtype = torch.bfloat16,
    group_name: str = WEIGHT_GROUP,
) -> list[dict]:
    """Send the current weights, as version `trainer.step` in `dtype` under HF names, to the engines
    of `group` (`connect_weight_group`): they receive while rank 0 broadcasts each tensor in the
    order announced. Call on every trainer rank (TP ranks gather); only rank 0 sends.

    Returns:
        The engines' replies (none on other ranks).
    Raises:
        EngineHTTPError: an engine refused or failed the update.
    """
    weights = trainer.engine_weights()
    if dist.is_initialized() and dist.get_rank() != 0:
        return []
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    )
    tensors = [t.to(device, dtype).contiguous() for t in weights.values()]
    names = [hf_name(n) for n in weights]
    dtypes, shapes = [str(dtype).removeprefix("torch.")] * len(names), [list(t.shape) for t in tensors]

    def send() -> None:
        for work in [dist.broadcast(t, group=group, group_src=0, async_op=True) for t in tensors]:
            work.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    _, *replies = await asyncio.gather(
        asyncio.to_thread(send),
        *(
            c.update_weights_from_distributed(names, dtypes, shapes, weight_version=trainer.step, group_name=group_name)
            for c in clients
        ),
    )
    return replies
