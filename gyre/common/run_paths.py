"""The run directory's layout: every file and folder a run writes in it, named here and nowhere
else (as submitit's `JobPaths`), so a writer and its readers (the report, the simulator's
calibration, the benchmarks, a resumed run) cannot disagree on a name.

    run_dir/
      .hydra/config.yaml     the resolved config (Hydra writes it)
      events.jsonl           every process's events (gyre.metrics.log)
      ledger.jsonl           the executions' states (gyre.coordinator.ledger)
      records/<eid>.jsonl    an execution's recorded turns (the proxy)
      sandboxes/             the executions' sandboxes
      checkpoints/           the core's trainer checkpoints
      weights/               weights the core published for its engines
      logs/cell<i>.log       a local cell leader's output (and its spec)
      <figure>.png           the run's figures (gyre.metrics.plots)
      summary.json           the run's summary
      slurm/                 a Slurm run's job folder (gyre.cells.slurm, gyre.launch.job)
      control.<pid>.port, core.<pid>.port, ranks.<pid>.config.json, rank<r>.<pid>.log
"""

import os
from dataclasses import dataclass
from pathlib import Path


def record_path(records_dir: str | os.PathLike, execution_id: str) -> Path:
    """An execution's records in a records folder (a run's, or a proxy's own `proxy.records_dir`)."""
    return Path(records_dir) / f"{execution_id}.jsonl"


@dataclass(frozen=True)
class RunPaths:
    """The paths of the run directory `root`."""

    root: Path

    def __init__(self, root: str | os.PathLike):
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / ".hydra" / "config.yaml"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.jsonl"

    @property
    def records(self) -> Path:
        return self.root / "records"

    def record(self, execution_id: str) -> Path:
        return record_path(self.records, execution_id)

    @property
    def sandboxes(self) -> Path:
        return self.root / "sandboxes"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def cell_log(self, cell: int) -> Path:
        return self.logs / f"cell{cell}.log"

    def cell_spec(self, cell: int) -> Path:
        return self.logs / f"cell{cell}.spec.json"

    def figure(self, name: str) -> Path:
        return self.root / f"{name}.png"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def slurm(self) -> Path:
        return self.root / "slurm"

    def control_port(self, pid: int) -> Path:
        """The coordinator's control listener's port file (MPI: its port name)."""
        return self.root / f"control.{pid}.port"

    def core_port(self, pid: int) -> Path:
        """The core's satellite listener's port file."""
        return self.root / f"core.{pid}.port"

    def ranks_config(self, pid: int) -> Path:
        """The config a cell leader hands its follower ranks."""
        return self.root / f"ranks.{pid}.config.json"

    def rank_log(self, rank: int, pid: int) -> Path:
        """A follower rank's output (`pid`: its leader's)."""
        return self.root / f"rank{rank}.{pid}.log"
