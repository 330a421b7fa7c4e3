"""Gyre's structured config at the Hydra edge: the root schema (gyre.coordinator.config.GyreConfig,
one typed field per Hydra group, each group's dataclass its package's own) registered in the
ConfigStore, and `validate`.

Hydra composes `conf/` against these dataclasses, so unknown keys and wrong types fail at
composition. Value checks live in each component's `__post_init__`; `validate` runs them and
names the offending key with its full dotted path (e.g. `cluster.cell_nodes`). The library never
reads YAML itself: entry points receive a composed DictConfig and call `validate`. A run's output
directory is Hydra's (`hydra.run.dir`), not a Gyre key.
"""

import importlib.util
from dataclasses import fields
from typing import Any, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from gyre.coordinator.config import GyreConfig
from gyre.errors import ConfigError

T = TypeVar("T")


def register_configs() -> None:
    """Register the root schema; its typed fields check every group's YAML merged into them."""
    ConfigStore.instance().store(name="gyre_schema", node=GyreConfig)


def validate(cfg: DictConfig, schema: type[T] = GyreConfig, runs_engines: bool = True) -> T:
    """Turn a composed config into typed objects of `schema` (GyreConfig, or gyre-sim's SimConfig),
    running every component's value checks; `runs_engines=False` (gyre-plan, which only plans them)
    skips the check that the engine asked for is installed here.

    Raises:
        ConfigError: naming the full dotted key of the first value that cannot run.
    """
    if schema is GyreConfig and runs_engines:
        _refuse_missing_sglang(cfg.engine)
    sections: dict[str, Any] = {}
    for f in fields(schema):
        node = cfg[f.name]
        try:
            sections[f.name] = OmegaConf.to_object(node) if OmegaConf.is_config(node) else node
        except ConfigError as e:
            raise e.under(f.name) from None
    return schema(**sections)


def _refuse_missing_sglang(engine: DictConfig) -> None:
    """A run must never serve with another engine than the one asked for: without sglang (and
    without its contract fake) `engine=sglang` stops here, before its own keys are checked."""
    if engine.backend != "sglang" or engine.get("sglang_fake", False):
        return
    if importlib.util.find_spec("sglang") is None:
        raise ConfigError(
            "engine.backend",
            "sglang is not installed here: `pip install 'gyre[sglang]'` on a CUDA node "
            "(or engine.sglang_fake=true for the CPU contract fake, tests only)",
        )
