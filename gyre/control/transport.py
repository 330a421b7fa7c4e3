"""One transport interface for control messages: a `Channel` per peer and a `Listener` that accepts them.

Two backends behind it, chosen by the address scheme: `tcp://host:port/KEY` (multiprocessing
connections with an authkey; the default) and `mpi:PORT_FILE` (MPI dynamic processes: the
listener publishes its port name in a file, one intercommunicator per peer; see
gyre/control/mpi.py). Both pass tests/integration/test_control_transport.py.

Messages travel pickled, but only the registered message classes (and the tensors a `Work`
carries) can be unpickled, and each arrives type-checked: anything else raises ProtocolError, the
caller drops that peer and keeps serving the rest. Authentication (the authkey, or the job's MPI
port file) is what keeps strangers out; the allowlist keeps a confused peer from crashing us.
"""

import io
import pickle
from abc import ABC, abstractmethod

from gyre.control.messages import ProtocolError, check
from gyre.errors import GyreError


class ChannelClosed(GyreError):
    """The peer closed the channel or died (EOF, a failed MPI call, or silence past the heartbeat timeout)."""


class ChannelTimeout(GyreError):
    """Nothing arrived within the timeout; the channel is still open."""


_MODULES = ("gyre.control.messages", "gyre.trajectory.sample", "torch._utils", "torch.storage", "torch")
_BUILTINS = {
    "dict",
    "list",
    "tuple",
    "set",
    "frozenset",
    "int",
    "float",
    "str",
    "bytes",
    "bytearray",
    "complex",
    "bool",
}
_OTHERS = {
    ("gyre.engines.published", "PublishedWeights"),
    ("collections", "OrderedDict"),
    ("copyreg", "_reconstructor"),
    ("builtins", "object"),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in _MODULES or (module == "builtins" and name in _BUILTINS) or (module, name) in _OTHERS:
            return super().find_class(module, name)
        raise ProtocolError(f"a control message may not contain {module}.{name}")


def encode(msg: object) -> bytes:
    """Bytes of a checked message (ProtocolError if it is not one)."""
    check(msg)
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> object:
    """The message in `data`, type-checked.

    Raises:
        ProtocolError: not a pickle, a forbidden type inside, or not a well-formed message.
    """
    try:
        msg = _Unpickler(io.BytesIO(data)).load()
    except ProtocolError:
        raise
    except Exception as e:  # any garbage: truncated, wrong protocol, a bad reduce
        raise ProtocolError(f"undecodable control message ({len(data)} bytes): {type(e).__name__}: {e}") from None
    check(msg)
    return msg


class Channel(ABC):
    """A two-way, ordered, message-at-a-time link to one peer. `send` may be called from several threads."""

    peer: str
    """Who is on the other side (for logs)."""

    @abstractmethod
    def send(self, msg: object) -> None:
        """Send one message. Raises ChannelClosed if the peer is gone, ProtocolError if `msg` is not a message."""

    @abstractmethod
    def recv(self, timeout_s: float | None = None) -> object:
        """The next message (blocking; at most `timeout_s` seconds if given).

        Raises:
            ChannelTimeout: nothing arrived in time.
            ChannelClosed: the peer closed or died.
            ProtocolError: the peer sent something that is not a message (drop it).
        """

    @abstractmethod
    def close(self) -> None:
        """Close the link (idempotent); a thread blocked in `recv` gets ChannelClosed."""

    def request(self, msg: object, timeout_s: float | None = None) -> object:
        """Send `msg` and return the reply."""
        self.send(msg)
        return self.recv(timeout_s)


class Listener(ABC):
    """Accepts channels from peers that `connect(self.address)`."""

    address: str

    @abstractmethod
    def accept(self, timeout_s: float | None = None) -> Channel:
        """The next peer's channel. Raises ChannelTimeout, or ChannelClosed once the listener is closed."""

    @abstractmethod
    def close(self) -> None:
        """Stop listening (idempotent); a thread blocked in `accept` gets ChannelClosed."""


def listen(
    backend: str = "tcp", host: str = "127.0.0.1", port_file: str | None = None, peer_timeout_s: float = 5.0
) -> Listener:
    """A listener on `backend`: "tcp" binds `host` (port 0 picks a free one); "mpi" publishes its port in
    `port_file` and declares a peer dead after `peer_timeout_s` of silence (TCP sees EOF instead)."""
    if backend == "tcp":
        from gyre.control.tcp import TcpListener

        return TcpListener(host)
    if backend == "mpi":
        from gyre.control.mpi import MpiListener

        if port_file is None:
            raise ValueError("the mpi backend needs port_file (where peers find the port name)")
        return MpiListener(port_file, peer_timeout_s=peer_timeout_s)
    raise ValueError(f"unknown control transport {backend!r}; valid: tcp, mpi")


def connect(address: str, timeout_s: float = 30.0, peer_timeout_s: float = 5.0) -> Channel:
    """A channel to the listener at `address` ("tcp://host:port/KEY" or "mpi:PORT_FILE"; mpi: the
    listener is declared dead after `peer_timeout_s` of silence)."""
    if address.startswith("tcp://"):
        from gyre.control.tcp import tcp_connect

        return tcp_connect(address)
    if address.startswith("mpi:"):
        from gyre.control.mpi import mpi_connect

        return mpi_connect(address.removeprefix("mpi:"), timeout_s, peer_timeout_s=peer_timeout_s)
    raise ValueError(f"unknown control address {address!r}: expected tcp://host:port/KEY or mpi:PORT_FILE")
