"""Servers as child processes, both sides. The child (`serve_app`) binds (port 0 = a free port),
tells the parent its port through a file and serves until SIGINT/SIGTERM; the parent
(`ChildServer`) spawns it, waits for that file and stops it. Shared by `gyre-engine` and `gyre-proxy`."""

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import NoReturn

from aiohttp import web

from gyre.common.files import write_private_file
from gyre.common.spawn import spawn_child
from gyre.common.wait import wait_until
from gyre.errors import GyreError


def exit_at_once(code: int) -> NoReturn:
    """End this process now: its log flushed, without the interpreter's teardown (unloading torch,
    megatron and Mooncake's native state takes a second or two per process and frees nothing its
    parent waits on). For a process that has closed what it owns, or must not wait to."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve_app(
    app: web.Application,
    host: str,
    port: int,
    name: str,
    *,
    port_file: str | None = None,
    port_file_extra: str = "",
    access_log: bool = True,
) -> None:
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


class ChildServerError(GyreError):
    """A server child exited or did not report its port in time; carries the tail of its log."""


class ChildServer:
    """The parent's side of `serve_app`: spawn the server in its own process group, its files (its
    output's log, the port file; the builtin engine's TMPDIR, its scratch) in a private directory,
    wait for the port file, stop it (TERM, then KILL) with everything it started, and remove the
    directory: files the child left (killed before its cleanup ran) go with it."""

    error: type[ChildServerError] = ChildServerError

    def __init__(self, name: str):
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.dir: Path | None = None
        """The child's files, from `spawn` until `stop`."""

    def files(self) -> Path:
        """The child's private directory (made on first use)."""
        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        return self.dir

    def spawn(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = spawn_child(cmd, self.files() / "log", env=env, own_session=True)

    def spawn_and_wait_port(self, cmd: list[str], timeout_s: float, env: dict[str, str] | None = None) -> list[str]:
        """Run `cmd --port-file F` and return the fields `serve_app` wrote to F (the port first).

        Raises:
            ChildServerError (or the subclass's `error`): the child exited or wrote nothing in time.
        """
        port_file = self.files() / "port"
        self.spawn([*cmd, "--port-file", str(port_file)], env)

        def reported() -> bool:
            self.check_alive()  # a child that died raises: no waiting out the timeout
            return port_file.exists()

        if not wait_until(reported, timeout_s):
            tail = self.log_tail()
            self.stop()
            raise self.error(f"{self.name}: no port reported after {timeout_s} s; log tail:\n{tail}")
        return port_file.read_text().split()

    def log_tail(self, n: int = 3000) -> str:
        path = self.dir / "log" if self.dir else None
        return path.read_text(errors="replace")[-n:] if path and path.exists() else "(no log)"

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.log_tail()
            self.stop()
            raise self.error(f"{self.name} exited with code {self.proc.returncode}; log tail:\n{tail}")

    def kill(self) -> None:
        """SIGKILL the process group, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def terminate(self) -> None:
        """SIGTERM the process group without waiting: `stop` then waits for it (several stop side by side)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the process group (SIGKILL after `timeout_s`), then remove its files."""
        if self.proc is not None and self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self.remove_files()

    def remove_files(self) -> None:
        """Remove the child's directory (a running child's open files stay valid until it exits)."""
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def start(self) -> "ChildServer":
        raise NotImplementedError

    def __enter__(self):
        return self.start() or self

    def __exit__(self, *exc) -> None:
        self.stop()


def first_exited(children: list["ChildServer"], stopping: threading.Event, every_s: float = 0.5):
    """The first of `children` seen exited, looking every `every_s`; None once `stopping` is set."""
    while not stopping.wait(every_s):
        for child in children:
            if child.proc.poll() is not None and not stopping.is_set():
                return child
    return None
