"""How far two runs' weights are apart at every step both kept a checkpoint of, beside the size of
one optimizer step: e.g. a live run with satellites against `mode=replay` of its records on the
core alone, which checks that the satellites' gradients are the core's own (summation order aside).

    .venv/bin/python tools/probe/compare_checkpoints.py RUN_A RUN_B
    # step k: |a - b| / |a| = ...   |a_k - a_(k-1)| / |a| = ...   (relative L2 norms of the flat weights)
"""

import sys
from pathlib import Path

from omegaconf import OmegaConf

from gyre.common.run_paths import RunPaths
from gyre.config import validate
from gyre.coordinator.config import GyreConfig
from gyre.train.checkpoint import CheckpointManager, list_checkpoints
from gyre.train.trainer import Trainer


def main() -> None:
    run_a, run_b = map(Path, sys.argv[1:3])
    cfg = validate(OmegaConf.merge(OmegaConf.structured(GyreConfig), OmegaConf.load(RunPaths(run_a).config)))
    trainer = Trainer(cfg.model, cfg.trainer)

    def weights(path: Path):
        CheckpointManager(path.parent, keep_last=1).load(trainer, path)
        return trainer.flat.weights.detach().clone()

    a, b = dict(list_checkpoints(RunPaths(run_a).checkpoints)), dict(list_checkpoints(RunPaths(run_b).checkpoints))
    previous = None
    for step in sorted(a.keys() & b.keys()):
        wa, wb = weights(a[step]), weights(b[step])
        apart = float((wa - wb).norm() / wa.norm())
        moved = f"{float((wa - previous[1]).norm() / wa.norm()):.3e}" if previous and previous[0] == step - 1 else "-"
        print(f"step {step}: |a - b| / |a| = {apart:.3e}   |a_k - a_(k-1)| / |a| = {moved}")
        previous = (step, wa)


if __name__ == "__main__":
    main()
