"""Free TCP ports, without the race of "bind port 0, close, hand the number on" (between the close
and the new owner's bind, any other bind to port 0 on the node may be given the same port).

A server of Gyre's own binds port 0 itself and reports what it got (`gyre.common.serve.serve_app`
writes a port file; `gyre.control.tcp` and `gyre.train.ranks` listen on port 0 in-process). A
program that must be told its port by number (SGLang's `--port` and `--dist-init-addr`, the
MASTER_PORT that torch's rank 0 binds for its group's store, a weight group's rendezvous, a
Mooncake master) gets a `PortReservation`: port 0 bound, with SO_REUSEADDR, and kept bound but not
listening until the program has bound it. Meanwhile the kernel gives that port to no other bind
(Linux counts every bound socket as a conflict when it picks a port for port 0), while the owner's
own bind succeeds: SO_REUSEADDR lets it share the port with a socket that is not listening, and
uvicorn, aiohttp, torch's TCPStore and Mooncake's master all set it.
"""

import socket


class PortReservation:
    """A free port on every address of this node, held for a program that binds it by number.
    Use as a context manager (or `close`) around the program's start, until it has bound the port."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("", 0))  # the wildcard: no bind to port 0 on any address gets this port
        self.port: int = self._sock.getsockname()[1]

    def close(self) -> None:
        """Let the port go (the program that took it keeps it)."""
        self._sock.close()

    def __enter__(self) -> int:
        return self.port

    def __exit__(self, *exc) -> None:
        self.close()
