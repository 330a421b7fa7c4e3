"""The one loader of published weights: an engine loads a `PublishedWeights` the way its `sync` says.

    mooncake     engine <─Mooncake read── core's buffer      (/update_weights_from_tensor, gyre_transfer)
    disk         engine <─HF directory─── core wrote it      (/update_weights_from_disk)
    distributed  core's sender ──/send──> engine's /init_weights_update_group (once) and
                 /update_weights_from_distributed, while the core's trainer broadcasts (NCCL; gloo on CPU)

`serve_weights` is the one way an engine comes to serve a version (the coordinator after a step and
at start, a cell leader returning to rollout): the proxy holds the engine's calls, the engine's
process object loads (its backend pauses generation around the update where the server needs it),
and the proxy, which keeps the version each engine serves, is told the outcome in a `finally`.
"""

from typing import TYPE_CHECKING, Protocol

from gyre.engines.client import EngineClient
from gyre.engines.published import PublishedWeights

if TYPE_CHECKING:
    from gyre.engines.launch import BaseEngineProcess


class VersionBoard(Protocol):
    """Where the version each engine serves is kept (the proxy's admin API, gyre.proxy.admin)."""

    async def hold_calls(self, engine_id: str) -> dict: ...

    async def set_weight_version(self, engine_id: str, version: int | None) -> dict: ...


async def serve_weights(
    engine: "BaseEngineProcess", engine_id: str, board: VersionBoard, weights: PublishedWeights
) -> None:
    """Have `engine` (registered on `board` as `engine_id`) serve `weights`.

    Its calls wait from before the load until the board knows its outcome, so none leaves keyed by a
    version the engine no longer serves; a failed load leaves the engine at the version it served.

    Raises:
        EngineHTTPError: the engine (or the core's sender) refused or failed the update.
    """
    await board.hold_calls(engine_id)
    served = None
    try:
        async with engine.client() as client:
            await engine.load(client, weights)
        served = weights.version
    finally:
        await board.set_weight_version(engine_id, served)


async def load_weights(client: EngineClient, weights: PublishedWeights, flush_cache: bool = True) -> dict:
    """Have the engine behind `client` serve `weights` (`flush_cache`: distributed only, False while
    an in_place pause holds calls whose KV SGLang must keep).

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
        body = {"engine_url": client.base_url, "version": weights.version, "flush_cache": flush_cache}
        reply = await sender.post("/send", body)
    client.weight_version = weights.version
    return reply


async def load_weights_at(engine_url: str, weights: PublishedWeights, timeout_s: float = 600.0) -> dict:
    """`load_weights` through a client of its own (no proxy: benchmarks, contract tests)."""
    async with EngineClient(engine_url, timeout_s) as client:
        return await load_weights(client, weights)
