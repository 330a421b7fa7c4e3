"""The one loader of published weights: an engine loads a `PublishedWeights` the way its `sync` says.

    mooncake     engine <─Mooncake read── core's buffer      (/update_weights_from_tensor, gyre_transfer)
    disk         engine <─HF directory─── core wrote it      (/update_weights_from_disk)
    distributed  core's sender ──/send──> engine's /init_weights_update_group (once) and
                 /update_weights_from_distributed, while the core's trainer broadcasts (NCCL; gloo on CPU)

Callers (the coordinator after a step, a cell leader returning to rollout) need only the engine's
URL and the message that carried the weights.
"""

from gyre.engines.client import EngineClient
from gyre.engines.published import PublishedWeights


async def load_weights(client: EngineClient, weights: PublishedWeights) -> dict:
    """Have the engine behind `client` serve `weights`.

    Returns:
        The engine's reply (for distributed: as the core's sender relays it).
    Raises:
        EngineHTTPError: the engine (or the core's sender) refused or failed the update; its body says why.
    """
    if weights.sync == "mooncake":
        return await client.update_weights_from_tensor(
            weight_version=weights.version, load_format="gyre_transfer", **weights.source
        )
    if weights.sync == "disk":
        return await client.update_weights_from_disk(weights.source["path"], weight_version=weights.version)
    async with EngineClient(weights.source["sender"], client.timeout.total or 600.0) as sender:
        reply = await sender.post("/send", {"engine_url": client.base_url, "version": weights.version})
    client.weight_version = weights.version
    return reply


async def load_weights_at(engine_url: str, weights: PublishedWeights, timeout_s: float = 600.0) -> dict:
    """`load_weights` through a client of its own."""
    async with EngineClient(engine_url, timeout_s) as client:
        return await load_weights(client, weights)
