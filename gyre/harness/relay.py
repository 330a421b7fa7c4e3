"""A byte relay from a listening socket to one target: how a container with no network reaches the proxy.

    host:       python -m gyre.harness.relay --listen fd:N --to tcp:127.0.0.1:PORT
                (a unix socket the sandbox bound, relayed to the proxy)
    container:  python -m gyre.harness.relay --listen tcp:127.0.0.1:PORT --to unix:/gyre/relay/proxy.sock -- HARNESS...
                (the proxy's URL works unchanged inside; the harness is this relay's child, its exit status
                the relay's, SIGTERM / SIGINT passed on to it)

Each accepted connection opens one to the target; bytes are copied both ways until both sides end.
"""

import argparse
import asyncio
import signal
import socket
import sys

CHUNK = 1 << 16


def parse_address(text: str) -> tuple[str, object]:
    """`tcp:HOST:PORT`, `unix:PATH` or `fd:N` (an already bound, listening socket) as (kind, address).

    Raises:
        ValueError: any other form.
    """
    kind, _, rest = text.partition(":")
    if kind == "tcp" and rest.rpartition(":")[2].isdigit():
        host, _, port = rest.rpartition(":")
        return kind, (host, int(port))
    if kind == "unix" and rest:
        return kind, rest
    if kind == "fd" and rest.isdigit():
        return kind, int(rest)
    raise ValueError(f"not an address (tcp:HOST:PORT, unix:PATH, fd:N): {text!r}")


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # a half-close passes on: the other side may still answer
    except OSError:
        writer.close()


async def _open(to: tuple[str, object]):
    kind, address = to
    return await (asyncio.open_unix_connection(address) if kind == "unix" else asyncio.open_connection(*address))


def _handler(to: tuple[str, object]):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await _open(to)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_copy(reader, target_writer), _copy(target_reader, writer))
        writer.close()
        target_writer.close()

    return handle


async def _listen(listen: tuple[str, object], to: tuple[str, object]) -> asyncio.Server:
    kind, address = listen
    if kind == "fd":
        return await asyncio.start_unix_server(_handler(to), sock=socket.socket(fileno=address))
    if kind == "unix":
        return await asyncio.start_unix_server(_handler(to), path=address)
    return await asyncio.start_server(_handler(to), *address)


async def relay(listen: tuple[str, object], to: tuple[str, object], argv: list[str]) -> int:
    """Serve until killed, or (with `argv`) until that child ends; returns its exit status."""
    server = await _listen(listen, to)
    if not argv:
        async with server:
            await server.serve_forever()
    child = await asyncio.create_subprocess_exec(*argv)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, child.send_signal, sig)
    code = await child.wait()
    server.close()
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    child = args[args.index("--") + 1 :] if "--" in args else []
    p = argparse.ArgumentParser(prog="gyre.harness.relay", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", type=parse_address, required=True)
    p.add_argument("--to", type=parse_address, required=True)
    opts = p.parse_args(args[: args.index("--")] if "--" in args else args)
    sys.exit(asyncio.run(relay(opts.listen, opts.to, child)))


if __name__ == "__main__":
    main()
