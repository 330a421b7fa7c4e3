"""Weights to engines after a step, under engine (HF/Qwen2) names, as version `trainer.step`.

Two ways, one per engine kind:
- `push_weights`: over Mooncake. The builtin engine reads the packed buffer with one transfer
  (`/update_weights_from_tensor`, load_format `gyre_transfer`).
- `write_weights` + `load_weights_from_disk`: a model directory (model.safetensors + config.json)
  that SGLang and the builtin engine load with `/update_weights_from_disk`.
Either way the engine bumps its `weight_version`; requests in flight continue and record the
version of each span they generated.
"""

import asyncio
import os

from gyre.engines.client import EngineClient
from gyre.models.checkpoint import save_checkpoint
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
    return await asyncio.gather(*(
        c.update_weights_from_tensor(weight_version=version, load_format="gyre_transfer", **descriptor) for c in clients
    ))


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
