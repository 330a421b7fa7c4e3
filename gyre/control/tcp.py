"""The TCP backend: multiprocessing connections authenticated with a random authkey.

A closed socket is how a side learns that its peer died (the kernel closes it with the process),
so no heartbeat is needed to detect a kill; a hung peer shows as a `recv` timeout.
"""

import os
import select
import socket
import threading
from multiprocessing.connection import AuthenticationError, Client, Connection, answer_challenge, deliver_challenge

from gyre.control.transport import Channel, ChannelClosed, ChannelTimeout, Listener, decode, encode


class TcpChannel(Channel):
    def __init__(self, conn: Connection, peer: str):
        self._conn, self.peer = conn, peer
        # multiprocessing writes a large message as header + payload: with Nagle's algorithm and
        # delayed ACKs that stalls each one ~40 ms
        with socket.socket(fileno=os.dup(conn.fileno())) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_lock = threading.Lock()
        self._closed = False

    def send(self, msg: object) -> None:
        self._send_bytes(encode(msg))

    def _send_bytes(self, data: bytes) -> None:
        with self._send_lock:
            try:
                self._conn.send_bytes(data)
            except (OSError, EOFError, ValueError) as e:  # ValueError: closed handle
                raise ChannelClosed(f"{self.peer}: send failed ({e})") from None

    def recv(self, timeout_s: float | None = None) -> object:
        try:
            if timeout_s is not None and not self._conn.poll(timeout_s):
                raise ChannelTimeout(f"{self.peer}: nothing within {timeout_s} s")
            data = self._conn.recv_bytes()
        # TypeError: closed by another thread between recv_bytes' closed check and its read (handle None)
        except (OSError, EOFError, ValueError, TypeError) as e:
            raise ChannelClosed(f"{self.peer}: closed ({type(e).__name__})") from None
        return decode(data)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:  # shut down first so a thread blocked in recv sees EOF
            socket.socket(fileno=os.dup(self._conn.fileno())).shutdown(socket.SHUT_RDWR)
        except (OSError, ValueError):
            pass
        self._conn.close()


class TcpListener(Listener):
    """Listens on `host` (all interfaces with "0.0.0.0"); the address carries the authkey."""

    def __init__(self, host: str = "127.0.0.1"):
        self._authkey = os.urandom(16)
        self._sock = socket.create_server((host, 0))
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False
        port = self._sock.getsockname()[1]
        advertised = socket.gethostname() if host in ("0.0.0.0", "") else host
        self.address = f"tcp://{advertised}:{port}/{self._authkey.hex()}"

    def accept(self, timeout_s: float | None = None) -> Channel:
        while True:
            if self._closed:
                raise ChannelClosed("listener closed")
            ready, _, _ = select.select([self._sock, self._wake_r], [], [], timeout_s)
            if self._closed or self._wake_r in ready:
                raise ChannelClosed("listener closed")
            if not ready:
                raise ChannelTimeout(f"no peer within {timeout_s} s")
            try:
                sock, peer = self._sock.accept()
            except OSError:
                continue
            conn = Connection(sock.detach())
            try:
                deliver_challenge(conn, self._authkey)
                answer_challenge(conn, self._authkey)
            except (AuthenticationError, OSError, EOFError):
                conn.close()  # a stranger or a dropped handshake: keep serving others
                continue
            return TcpChannel(conn, f"tcp peer {peer[0]}:{peer[1]}")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.write(self._wake_w, b"x")
            self._sock.close()  # the pipe stays open: a thread may still be selecting on it


def tcp_connect(address: str) -> Channel:
    """Connect to "tcp://host:port/KEY"; raises ChannelClosed if nobody listens or the key is wrong."""
    hostport, _, key = address.removeprefix("tcp://").partition("/")
    host, _, port = hostport.rpartition(":")
    try:
        conn = Client((host, int(port)), authkey=bytes.fromhex(key))
    except (OSError, EOFError, AuthenticationError) as e:
        raise ChannelClosed(f"cannot connect to {hostport}: {type(e).__name__}: {e}") from None
    return TcpChannel(conn, f"tcp {hostport}")
