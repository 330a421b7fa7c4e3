"""A run on Slurm: `submit_run` (gyre-train, cluster.backend=slurm) and `GyreJob`, what every task of its job runs.

    gyre-train ─ partition checked ─ submitit ─> one het job, one srun step over all components
      component 0, rank 0: the coordinator (gyre.coordinator.loop), resuming when SLURM_RESTART_COUNT > 0
          USR2 ─> finished steps checkpointed ─> all closed ─> scontrol requeue ─> exit ─> (restart)
      component k+1: cell k (gyre.cells.slurm.run_cell_task)
    gyre-train waits for the job's result, the summary, across requeues (`submitit.Job.result`).

The coordinator runs inside the job, as its first component, not on the submit host: then the
run is one allocation that Slurm preempts, requeues and restarts as a unit (coordinator, proxy,
sandboxes and every cell together), a restart finds the run directory and resumes, and no
long-lived process is needed on a login node (gyre-train may go away; the job goes on).

Every rank of every cell is a task (`cluster.ranks_per_node` on each of a cell's nodes: its first
the leader, the others its followers); what submitit unpickles is only `GyreJob(run_dir)` from
this light module, and the config and task set wait in `slurm/run.pkl`.
"""

import faulthandler
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

from gyre.cells.placement import SlurmPlacement, current_placement, forget_enclosing_job
from gyre.common import jsonio
from gyre.common.run_paths import RunPaths

log = logging.getLogger(__name__)
SIGNAL_DELAY_S = 120
"""The warning Slurm gives before the time limit (`--signal=USR2@120`): time to checkpoint and close."""


class GyreJob:
    """The function submitit runs in every task of the run's het job; its placement says which part it is."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir

    def __call__(self) -> dict | None:
        faulthandler.enable()  # a task that dies in native code (MPI, Mooncake) leaves its Python stack in the log
        placement, job_dir = current_placement(), RunPaths(self.run_dir).slurm
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        with open(job_dir / "run.pkl", "rb") as f:
            cfg, taskset = pickle.load(f)
        os.environ.update(cfg.site_env())  # the fabric, for this task and what it starts (leaders, engines)
        if placement.het_group > 0:
            from gyre.cells.slurm import run_cell_task

            run_cell_task(job_dir, placement, cfg.cluster.bind_host, cfg.coordinator.cell_start_timeout_s)
            return None
        return self._coordinate(placement, job_dir, cfg, taskset)

    def _coordinate(self, placement: SlurmPlacement, job_dir: Path, cfg, taskset) -> dict:
        import asyncio

        from gyre.cells.slurm import coordinator_exit_path
        from gyre.common.files import write_private_file
        from gyre.coordinator.loop import Preempted, run
        from gyre.launch.preempt import PreemptionSignal

        preempt = PreemptionSignal(signal.SIGUSR2).install()
        resume = cfg.resume or placement.restart_count > 0
        log.warning(
            "coordinator on %s: job %s, restart %d, resume=%s",
            placement.node,
            placement.job_id,
            placement.restart_count,
            resume,
        )
        try:
            return asyncio.run(run(cfg, self.run_dir, taskset, resume=resume, preempt=preempt.event))
        except Preempted as e:
            closed_t = time.time()
            # The requeue SIGTERMs this job's processes, scontrol among them; ignored (inherited across
            # exec), it cannot cut the requeue short nor this exit (seen: scontrol killed mid-requeue).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            subprocess.run(["scontrol", "requeue", placement.job_id], check=True, timeout=60)
            times = {
                "signal_t": preempt.received_t,
                "closed_t": closed_t,
                "requeue_t": time.time(),
                "restart_count": placement.restart_count,
                "reason": str(e),
            }
            write_private_file(job_dir / f"preempted.r{placement.restart_count}.json", jsonio.dumps(times))
            log.warning("requeued job %s: %s", placement.job_id, e)
            sys.exit(-1)  # as submitit's own handler: no result for this run, the requeued one writes it
        finally:
            coordinator_exit_path(job_dir, placement.restart_count).touch()


def submit_run(cfg, taskset, run_dir: Path):
    """Check the partition's limits, then submit the run (GyreConfig, TaskSource) as one het job.

    Returns:
        The submitit.Job (running or queued).
    Raises:
        SlurmConfigError: the partition is unknown, or too small or too short for the run (names the key).
    """
    from gyre.common.files import write_private_file
    from gyre.launch.slurm import check_fits, make_hetjob_executor, make_run_components, query_partition

    forget_enclosing_job()
    check_fits(cfg.cluster, query_partition(cfg.cluster.partition))
    job_dir, submitted_t = RunPaths(run_dir).slurm, time.time()
    job_dir.mkdir(parents=True, exist_ok=True)
    write_private_file(job_dir / "run.pkl", pickle.dumps((cfg, taskset)))
    executor = make_hetjob_executor(
        cfg.cluster, make_run_components(cfg.cluster), job_dir, name="gyre", slurm_signal_delay_s=SIGNAL_DELAY_S
    )
    job = executor.submit(GyreJob(run_dir))
    (job_dir / "job.json").write_text(jsonio.dumps({"job_id": job.job_id, "submitted_t": submitted_t}))
    return job
