"""Weights to engines after a step: the core's weights under engine names, pushed over Mooncake.

The builtin engine reads them with one transfer (`/update_weights_from_tensor`, load_format
`gyre_transfer`); SGLang on GPUs takes `/update_weights_from_disk` with a directory written by
gyre/models/checkpoint.py. The engine bumps its `weight_version`; requests in flight continue and
record the version of each span they generated.
"""

import asyncio

from gyre.engines.client import EngineClient
from gyre.train.trainer import Trainer
from gyre.transfer import TransferEndpoint


async def push_weights(trainer: Trainer, endpoint: TransferEndpoint, clients: list[EngineClient]) -> list[dict]:
    """Publish the trainer's current weights once and have every engine pull them.

    The weight version is the trainer's step. Returns the engines' replies.
    Raises:
        EngineHTTPError: an engine refused or failed the update (its body says why).
    """
    descriptor, buffer = endpoint.publish_tensors(trainer.engine_weights())
    try:
        return await asyncio.gather(*(
            c.update_weights_from_tensor(weight_version=str(trainer.step), load_format="gyre_transfer", **descriptor)
            for c in clients
        ))
    finally:
        endpoint.unregister(buffer)
