"""Run one aiohttp app as a process's server: bind (port 0 = a free port), tell the parent the port
through a file, serve until SIGINT/SIGTERM. Shared by `gyre-engine` and `gyre-proxy`."""

import asyncio
import os

from aiohttp import web


def write_private_file(path: str, text: str) -> None:
    """Write `text` owner-only, atomically (a reader never sees half a file): it may carry a token."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def serve_app(app: web.Application, host: str, port: int, name: str, *, port_file: str | None = None,
              port_file_extra: str = "", access_log: bool = True) -> None:
    """Serve `app` until stopped; once listening, write `<port>[ <port_file_extra>]` to `port_file`."""

    async def run() -> None:
        runner = web.AppRunner(app, handle_signals=True, **({} if access_log else {"access_log": None}))
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        bound = runner.addresses[0][1]
        if port_file:
            write_private_file(port_file, f"{bound} {port_file_extra}".strip())
        print(f"{name}: serving on http://{host}:{bound}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
