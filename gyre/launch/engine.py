"""`gyre-engine`: the Hydra app that composes the config and serves one rollout engine.

`gyre-engine engine.port=30000 model=tiny` serves the `model` group's architecture on CPU with random
weights (or `engine.model_path=DIR`); `engine=sglang` launches `sglang.launch_server` with the flags
of gyre.engines.launch. Either through the one factory the cell leaders use, until SIGINT/SIGTERM.
"""

import signal
import sys
import threading

import hydra
from omegaconf import DictConfig

from gyre.common import CONF_DIR
from gyre.config import register_configs, validate
from gyre.engines.launch import make_engine_process
from gyre.errors import ConfigError

register_configs()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def run(cfg: DictConfig) -> None:
    try:
        gyre_cfg = validate(cfg)
    except ConfigError as e:
        sys.exit(f"gyre-engine: invalid config: {e}")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with make_engine_process(gyre_cfg.engine, gyre_cfg.model) as engine:
        print(f"gyre-engine: {gyre_cfg.engine.backend} serving on {engine.url}", flush=True)
        stop.wait()


def main() -> None:
    run()


if __name__ == "__main__":
    main()
