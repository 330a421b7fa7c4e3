"""The site's fabric for Mooncake transfers (`transfer.*`), and the one place that reads it back in a process.

Every Mooncake endpoint of a run (trainer shards, published weights, KV hand-offs; and the SGLang
HiCache store's client) uses the same protocol and NICs. The launcher exports them once per process
tree (`fabric_env`: gyre-train locally, each Slurm task from the pickled config), as Mooncake's own
switches are environment variables too (MC_FORCE_TCP, MOONCAKE_PROTOCOL, MOONCAKE_DEVICE), and
`TransferEndpoint` reads them here, so no endpoint needs the config passed down to it.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass

from gyre.errors import require

PROTOCOLS = ("tcp", "rdma")
ENV_PROTOCOL, ENV_DEVICE = "GYRE_TRANSFER_PROTOCOL", "GYRE_TRANSFER_DEVICE"
_DEVICE = re.compile(r"^[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$")


@dataclass(kw_only=True)
class TransferConfig:
    """How Mooncake endpoints reach each other: the same on every node of the run."""

    protocol: str = "tcp"
    """One of PROTOCOLS. tcp: forced even where HCAs exist (Mooncake's MC_FORCE_TCP; its wheel picks
    RDMA whenever it finds HCAs otherwise). rdma: InfiniBand/RoCE verbs; GPU memory needs
    nvidia-peermem or dmabuf (docs/slurm.md)."""
    device: str = ""
    """NICs for rdma, comma-separated HCA names as `ibv_devices` lists them (e.g. `mlx5_0,mlx5_1`);
    empty: every device Mooncake finds."""

    def __post_init__(self):
        require(self.protocol in PROTOCOLS, "protocol", f"must be one of {', '.join(PROTOCOLS)}; got {self.protocol!r}")
        require(
            not self.device or bool(_DEVICE.match(self.device)),
            "device",
            f"must be comma-separated NIC names (e.g. mlx5_0,mlx5_1), got {self.device!r}",
        )

    def env(self) -> dict[str, str]:
        """The variables that carry this fabric to every process of the run (see the module doc)."""
        return {ENV_PROTOCOL: self.protocol, ENV_DEVICE: self.device}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "TransferConfig":
        """The fabric the launcher exported (`env`); the defaults (tcp) where none was."""
        return cls(protocol=env.get(ENV_PROTOCOL) or "tcp", device=env.get(ENV_DEVICE, ""))
