"""`gyre-engine`: the Hydra app that composes the config and serves the builtin engine (CPU).

`gyre-engine engine.port=30000 model=tiny` serves the `model` group's architecture with random
weights (or `engine.model_path=DIR`). For `engine=sglang`, run `sglang.launch_server` through
gyre.engines.launch instead: SGLang is its own server.
"""

import sys

import hydra
from omegaconf import DictConfig

from gyre.common import CONF_DIR
from gyre.config import register_configs, validate
from gyre.engines.server import serve
from gyre.errors import ConfigError

register_configs()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def run(cfg: DictConfig) -> None:
    try:
        gyre_cfg = validate(cfg)
    except ConfigError as e:
        sys.exit(f"gyre-engine: invalid config: {e}")
    if gyre_cfg.engine.backend != "builtin":
        sys.exit(
            "gyre-engine serves only engine=builtin; SGLang runs as `python -m sglang.launch_server` "
            "(gyre.engines.launch)"
        )
    serve(gyre_cfg.engine, gyre_cfg.model)


def main() -> None:
    run()


if __name__ == "__main__":
    main()
