"""`gyre-proxy`: run the proxy until SIGINT/SIGTERM, and a child-process launcher for tests and tools."""

import argparse
import dataclasses
import gc
import logging
import sys

from gyre.common.files import read_child_config, write_child_config
from gyre.common.serve import ChildServer, serve_app
from gyre.models.tokenizer import load_tokenizer
from gyre.proxy.config import ProxyConfig
from gyre.proxy.server import ProxyServer


def serve(cfg: ProxyConfig, port_file: str | None = None) -> None:
    """Serve until stopped; writes `port admin_token` to `port_file` (atomically) once listening."""
    tok = load_tokenizer(cfg.tokenizer_path, cfg.vocab_size)
    server = ProxyServer(cfg, tok)
    # Everything imported so far (aiohttp, numpy, transformers and torch with an HF tokenizer) lives
    # as long as the process: moved out of the collector's reach, a full collection (triggered as
    # each call's parsed body grows the old generation) no longer walks it. With an HF tokenizer at
    # 1M-token contexts this measured ~25% less CPU per call (tools/bench/proxy_context.py).
    gc.freeze()
    # A call's parsed body lives until the conversation's next call replaces its snapshot (~6,300
    # tracked containers at a 1M-token context). At the default threshold (700) young collections
    # run inside every parse and promote each body to the old generations, whose collections walk it
    # again; at 100,000 net new containers a body is mostly freed before any collection sees it
    # (~1 ms less CPU per call at 1M in tools/bench/proxy_context.py). Cyclic garbage waits as long.
    gc.set_threshold(100_000, 10, 10)

    # The port file is owner-only: it carries the admin token.
    serve_app(
        server.app(),
        cfg.host,
        cfg.port,
        "gyre-proxy",
        port_file=port_file,
        port_file_extra=server.admin_token,
        access_log=False,
    )


def main(argv: list[str] | None = None) -> None:
    """`gyre-proxy [--config FILE] [--port-file F]` (FILE: ProxyConfig fields as JSON, a private file:
    they may hold the admin token)."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument(
        "--config", default=None, help="a JSON file of ProxyConfig fields (gyre.common.files.write_child_config)"
    )
    p.add_argument("--port-file", default=None, help="written with '<port> <admin token>' once listening")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = ProxyConfig(**(read_child_config(a.config) if a.config else {}))
    except (OSError, TypeError, ValueError) as e:
        sys.exit(f"gyre-proxy: invalid config: {e}")
    serve(cfg, a.port_file)


class ProxyProcess(ChildServer):
    """`gyre-proxy` as a child process on a free port; `url` and `admin_token` valid after start()."""

    def __init__(self, cfg: ProxyConfig, startup_timeout_s: float = 60.0):
        super().__init__("gyre-proxy")
        self.cfg, self.startup_timeout_s = cfg, startup_timeout_s
        self.url, self.admin_token = "", ""

    def start(self) -> "ProxyProcess":
        cmd = [
            sys.executable,
            "-m",
            "gyre.proxy.main",
            "--config",
            write_child_config(self.files() / "config.json", dataclasses.asdict(self.cfg)),
        ]
        port, self.admin_token = self.spawn_and_wait_port(cmd, self.startup_timeout_s)
        self.url = f"http://{self.cfg.host}:{port}"
        return self


if __name__ == "__main__":
    main()
