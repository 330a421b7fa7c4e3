"""The one weight-publish contract: what the core publishes after a step and every engine loads.

`PublishedWeights` travels in control messages (CellReady, RoleSwitch, StepDone) from the core to
the coordinator and the cell leaders; `gyre.engines.weights.load_weights` is its one loader, with
one way per `engine.weight_sync`. Pure: no I/O here, so the control transport may unpickle it.
"""

from dataclasses import dataclass

WEIGHT_SYNCS = ("mooncake", "distributed", "disk")
"""How engines fetch published weights: `mooncake` (builtin engine only: one Mooncake read of the
core's buffer, `/update_weights_from_tensor` load_format `gyre_transfer`), `distributed` (SGLang's
`/init_weights_update_group` + `/update_weights_from_distributed`: the core's trainer broadcasts
over NCCL, gloo on CPU), `disk` (`/update_weights_from_disk` of an HF directory the core wrote)."""


@dataclass(frozen=True)
class PublishedWeights:
    """Weight version `version` (the core's optimizer step) and how to fetch it.

    `source` by `sync`: mooncake, the buffer's descriptor {session_id, address, layout}; distributed,
    {"sender": URL of the core's weight sender (gyre.train.publish)}; disk, {"path": model directory}.
    """

    version: int
    sync: str
    source: dict

    def __post_init__(self):
        if self.sync not in WEIGHT_SYNCS:
            raise ValueError(f"PublishedWeights.sync must be one of {list(WEIGHT_SYNCS)}, got {self.sync!r}")
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"PublishedWeights.version must be an integer >= 0, got {self.version!r}")
