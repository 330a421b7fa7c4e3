"""`gyre-plan`: where a run's ranks and engines sit on a node's GPUs and whether one GPU's memory
holds them, from the same Hydra overrides as `gyre-train`, before anything starts.

It reads the model's config.json only (no weights), prints the plan by part (gyre.launch.memory)
and last one JSON object; it exits 1 where the plan does not fit, naming the keys to change.
`gyre-train` runs the same check at start on a GPU cluster (`check_gpu_plan`).
"""

import sys

import hydra
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from gyre.cells.serving import CellLayout, plan_cell
from gyre.common import CONF_DIR
from gyre.config import register_configs, validate
from gyre.coordinator.config import GyreConfig
from gyre.errors import ConfigError
from gyre.launch.memory import GpuShape, MemoryPlan, plan_memory, render_plan


def gpu_shape(cfg: GyreConfig) -> GpuShape:
    """The plan's inputs from a validated config: the core's GPU (it holds the satellites' slots)."""
    c, t = cfg.cluster, cfg.trainer
    return GpuShape(
        model=cfg.model,
        trainer_tp=t.tensor_parallel_size,
        data_parallel=c.ranks_per_cell // t.tensor_parallel_size,
        core_slots=t.num_grad_slots if c.num_cells > 1 and cfg.scheduler.mode != "colocate" else 0,
        micro_batch_tokens=cfg.coordinator.max_micro_batch_tokens,
        engine_tp=cfg.engine.tp_size,
        engine_on_gpu=cfg.engine.on_gpu,
        mem_fraction_static=cfg.engine.mem_fraction_static,
        context_len=cfg.proxy.context_len,
        capacity_bytes=int(c.gpu_mem_gb * 1e9),
    )


def plan_run(cfg: GyreConfig) -> tuple[CellLayout, MemoryPlan]:
    """A cell's layout and its core GPU's memory plan (pure)."""
    c = cfg.cluster
    tp = cfg.trainer.tensor_parallel_size
    e = cfg.engine
    layout = plan_cell(c.ranks_per_cell, c.cell_nodes, c.gpus_per_node, e.tp_size, e.on_gpu, tp, nnodes=e.nnodes)
    return layout, plan_memory(gpu_shape(cfg))


def check_gpu_plan(cfg: GyreConfig) -> None:
    """gyre-train's start check on a GPU cluster (a CPU one is not planned: it starts as always).

    Raises:
        ConfigError: naming the first key to change when a GPU's memory does not hold the plan.
    """
    if not cfg.cluster.gpus_per_node:
        return
    _, plan = plan_run(cfg)
    if not plan.fits:
        others = f"; or change {', '.join(plan.keys[1:])}" if len(plan.keys) > 1 else ""
        raise ConfigError(plan.keys[0], "; ".join(plan.problems) + f"{others} (gyre-plan shows the plan)")


def main(argv: list[str] | None = None) -> int:
    """Compose `argv`'s overrides, print the plan; 0 when it fits, 1 when not, 2 for a bad config."""
    register_configs()
    overrides = sys.argv[1:] if argv is None else argv
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        try:
            cfg = validate(hydra.compose(config_name="config", overrides=overrides), runs_engines=False)
        except (ConfigError, HydraException, OmegaConfBaseException) as e:
            print(f"gyre-plan: invalid config: {e}", file=sys.stderr)
            return 2
    layout, plan = plan_run(cfg)
    for line in render_plan(plan, cfg.cluster.ranks_per_cell // cfg.cluster.cell_nodes, layout.node_devices(0)):
        print(line, flush=True)
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
