"""`gyre-train`: the Hydra app that composes, validates and runs a Gyre job (the coordinator).

The run directory is Hydra's (`hydra.run.dir`); the summary's last line is one JSON object, also
written to RUN_DIR/summary.json.
"""

import asyncio
import logging
import os
import sys
from pathlib import Path

import hydra
from hydra._internal.utils import get_args_parser
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from gyre.common import CONF_DIR, jsonio
from gyre.common.files import write_private_file
from gyre.common.run_paths import RunPaths
from gyre.config import register_configs, validate
from gyre.coordinator.config import GyreConfig
from gyre.errors import ConfigError, GyreError
from gyre.launch.plan import check_gpu_plan
from gyre.tasks.taskset import TaskSet, TaskSource, toy_taskset

register_configs()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def run(cfg: DictConfig) -> None:
    try:
        gyre_cfg = validate(cfg)
        check_gpu_plan(gyre_cfg)  # a GPU cluster's placement and memory, before anything starts
    except ConfigError as e:
        sys.exit(f"gyre-train: invalid config: {e}")
    from hydra.core.hydra_config import HydraConfig

    from gyre.coordinator.loop import run as run_coordinator

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        taskset = load_tasks(gyre_cfg)
    except GyreError as e:
        sys.exit(f"gyre-train: {e}")
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    os.environ.update(gyre_cfg.site_env())  # local cells are this process's children; Slurm tasks set their own
    if gyre_cfg.cluster.backend == "slurm":
        summary = run_on_slurm(gyre_cfg, taskset, run_dir)
    else:
        summary = asyncio.run(run_coordinator(gyre_cfg, run_dir, taskset, resume=gyre_cfg.resume))
    write_private_file(RunPaths(run_dir).summary, jsonio.dumps(summary))  # for sweeps, whose stdout is a job's log
    print(jsonio.dumps(summary), flush=True)


def run_on_slurm(cfg: GyreConfig, taskset: TaskSource, run_dir: Path) -> dict:
    """Submit the run as one het job (the coordinator inside it) and wait for its summary, across requeues.

    Interrupting gyre-train cancels the job: a run someone stopped must not hold its allocation.
    """
    from gyre.launch.job import submit_run

    try:
        job = submit_run(cfg, taskset, run_dir)
    except ConfigError as e:
        sys.exit(f"gyre-train: invalid config: {e}")
    print(f"gyre-train: submitted Slurm job {job.job_id}; logs in {run_dir / 'slurm'}", file=sys.stderr, flush=True)
    try:
        return job.result()
    except KeyboardInterrupt:
        job.cancel()
        raise


def load_tasks(cfg: GyreConfig) -> TaskSet:
    """The run's task set; warm-starts the initial policy on it when asked (sets init_weights) and
    the model is Gyre's own tiny family (a Hugging Face checkpoint is already a trained policy).
    Harbor tasks are checked against `harness.isolation` here, before any execution starts.

    Raises:
        TaskSpecError: a task spec that does not load (names the task and the field).
        SandboxError: a Harbor task this machine's sandboxes cannot run (names the task and the key).
    """
    from gyre.harness.podman import podman_available
    from gyre.harness.sandbox import bwrap_available, check_isolation

    taskset = TaskSet.load(cfg.tasks.path, cfg.tasks) if cfg.tasks.path else toy_taskset()
    for task in taskset.tasks:
        if task.environment is not None:  # on Slurm the nodes' bubblewrap is checked by each sandbox
            slurm = cfg.cluster.backend == "slurm"
            check_isolation(task, cfg.harness, slurm or bwrap_available(), slurm or podman_available())
    wants_warm = cfg.tasks.warm_start and cfg.coordinator.init_weights is None and cfg.model.path is None
    if wants_warm and not any("files" in (t.reference or {}) for t in taskset.tasks):
        print("gyre-train: warm start skipped: no task has reference files to demonstrate", file=sys.stderr)
    elif wants_warm:  # on resume too: the checkpoints hold the weights, the warm start's directory the vocabulary
        from gyre.launch.warmstart import WarmStartConfig, warm_start
        from gyre.models.tokenizer import has_bpe_tokenizer

        ws = WarmStartConfig(clear_chars=cfg.harness.toy.clear_chars)
        out, report = warm_start(Path(cfg.tasks.warm_start_dir), taskset, cfg.model, ws)
        print(
            f"gyre-train: warm start {'reused' if report['reused'] else 'trained'}: {out} "
            f"(first turns scored {report['after']}, {report['train_cpu_s']} CPU-s)",
            file=sys.stderr,
            flush=True,
        )
        cfg.coordinator.init_weights = str(out)
        if cfg.proxy.tokenizer_path is None and has_bpe_tokenizer(out):
            cfg.proxy.tokenizer_path = str(out)
    return taskset


def check_config(overrides: list[str]) -> None:
    """Compose and validate without running, so `--cfg` never prints a config that cannot run.

    Hydra prints `--cfg` output before any task code runs; this check runs first instead.
    """
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        try:
            validate(hydra.compose(config_name="config", overrides=overrides))
        except (ConfigError, HydraException, OmegaConfBaseException) as e:
            sys.exit(f"gyre-train: invalid config: {e}")


def main() -> None:
    args, _ = get_args_parser().parse_known_args()
    if args.cfg and not args.multirun and not args.config_dir and not args.config_name:
        check_config(args.overrides)
    run()


if __name__ == "__main__":
    main()
