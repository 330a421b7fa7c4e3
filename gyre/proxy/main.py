"""`gyre-proxy`: run the proxy until SIGINT/SIGTERM, and a child-process launcher for tests and tools."""

import argparse
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gyre.errors import GyreError
from gyre.launch.serve import serve_app
from gyre.models.tokenizer import ByteTokenizer, HFTokenizer
from gyre.proxy.config import ProxyConfig
from gyre.proxy.server import ProxyServer


def serve(cfg: ProxyConfig, port_file: str | None = None) -> None:
    """Serve until stopped; writes `port admin_token` to `port_file` (atomically) once listening."""
    tok = HFTokenizer(cfg.tokenizer_path) if cfg.tokenizer_path else ByteTokenizer(cfg.vocab_size)
    server = ProxyServer(cfg, tok)

    # The port file is owner-only: it carries the admin token.
    serve_app(server.app(), cfg.host, cfg.port, "gyre-proxy", port_file=port_file,
              port_file_extra=server.admin_token, access_log=False)


def main(argv: list[str] | None = None) -> None:
    """`gyre-proxy --config-json '{...}' [--port-file F]` (ProxyConfig fields as JSON)."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--config-json", default="{}", help="ProxyConfig fields as JSON")
    p.add_argument("--port-file", default=None, help="written with '<port> <admin token>' once listening")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = ProxyConfig(**json.loads(a.config_json))
    except (TypeError, ValueError) as e:
        sys.exit(f"gyre-proxy: invalid config: {e}")
    serve(cfg, a.port_file)


class ProxyProcess:
    """`gyre-proxy` as a child process on a free port; `url` and `admin_token` valid after start()."""

    def __init__(self, cfg: ProxyConfig, startup_timeout_s: float = 60.0):
        self.cfg, self.startup_timeout_s = cfg, startup_timeout_s
        self.url, self.admin_token = "", ""
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="gyre-proxy-", suffix=".log", delete=False)

    def start(self) -> "ProxyProcess":
        port_file = self._log.name + ".port"
        cmd = [sys.executable, "-m", "gyre.proxy.main", "--config-json", json.dumps(dataclasses.asdict(self.cfg)), "--port-file", port_file]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise GyreError(f"gyre-proxy did not start; log tail:\n{self.log_tail()}")
            time.sleep(0.05)
        port, self.admin_token = Path(port_file).read_text().split()
        os.unlink(port_file)
        self.url = f"http://{self.cfg.host}:{port}"
        return self

    def log_tail(self, n: int = 3000) -> str:
        return Path(self._log.name).read_text(errors="replace")[-n:]

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests of record durability)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> "ProxyProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        os.unlink(self._log.name)


if __name__ == "__main__":
    main()
