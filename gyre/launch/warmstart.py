"""`python -m gyre.launch.warmstart --out DIR [overrides]`: fill the warm-start cache ahead of a run
(gyre.tasks.warmstart), with the model and toy settings gyre-train composes from the same overrides."""

import argparse
import json
from pathlib import Path

import hydra
import torch

from gyre.common import CONF_DIR
from gyre.config import register_configs, validate
from gyre.tasks.taskset import TaskSet
from gyre.tasks.warmstart import WarmStartConfig, warm_start


def main(argv: list[str] | None = None) -> None:
    """The warm start gyre-train makes for the same overrides (its model and the toy's clear_chars)."""
    p = argparse.ArgumentParser(prog="python -m gyre.launch.warmstart", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="cache directory; the model goes to OUT/warmstart-<hash>")
    p.add_argument("--taskset", default=None)
    p.add_argument("--steps", type=int, default=WarmStartConfig.steps)
    p.add_argument("--lr", type=float, default=WarmStartConfig.lr)
    p.add_argument("--samples-per-task", type=int, default=1)
    p.add_argument("overrides", nargs="*", help="gyre-train's Hydra overrides (e.g. model.hidden_size=256)")
    a = p.parse_args(argv)
    register_configs()
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = validate(hydra.compose(config_name="config", overrides=a.overrides))
    torch.set_num_threads(1)
    taskset = TaskSet.load(a.taskset) if a.taskset else None
    ws = WarmStartConfig(steps=a.steps, lr=a.lr, clear_chars=cfg.harness.toy.clear_chars)
    out, report = warm_start(Path(a.out), taskset, cfg.model, ws, samples_per_task=a.samples_per_task)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
