"""PortReservation: a port held for a program that binds it by number, given to no one else meanwhile."""

import asyncio
import errno
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from gyre.common.ports import PortReservation


async def _serve_and_answer(port: int) -> bytes:
    """An asyncio server (as uvicorn and aiohttp bind: SO_REUSEADDR) on `port`, answering one connection."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hello")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", port)
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        got = await reader.read()
        writer.close()
        return got


def test_while_reserved_nothing_listens_and_a_plain_bind_is_refused():
    with PortReservation() as port:
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED
        with socket.socket() as other, pytest.raises(OSError) as refused:
            other.bind(("127.0.0.1", port))  # as a bind to port 0 elsewhere is never given it
        assert refused.value.errno == errno.EADDRINUSE
    with socket.socket() as after:
        after.bind(("127.0.0.1", port))  # closed: the port is free again


def test_the_program_it_is_reserved_for_binds_and_serves_it_while_held():
    with PortReservation() as port:
        assert asyncio.run(_serve_and_answer(port)) == b"hello"
        store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=10))  # MASTER_PORT's
        store.set("k", "v")
        assert store.get("k") == b"v"
        del store


def test_two_reservations_get_two_ports():
    with PortReservation() as a, PortReservation() as b:
        assert a != b and 0 < a < 65536 and 0 < b < 65536
