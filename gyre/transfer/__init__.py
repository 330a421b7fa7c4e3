"""Transfer: move bytes between processes with the Mooncake Transfer Engine (TCP here, RDMA on clusters).

`layout` is the pure part (how named tensors pack into one flat buffer); `engine` is the I/O edge
(a Mooncake endpoint that registers buffers and reads/writes a peer's registered memory); `arena`
is memory touched once and registered once that transfer buffers are carved from; `config` is the
site's fabric every endpoint uses.
"""

from gyre.transfer.arena import TransferArena
from gyre.transfer.config import TransferConfig
from gyre.transfer.engine import TransferEndpoint, TransferError
from gyre.transfer.layout import BufferLayout, TensorSlot

__all__ = ["BufferLayout", "TensorSlot", "TransferArena", "TransferConfig", "TransferEndpoint", "TransferError"]
