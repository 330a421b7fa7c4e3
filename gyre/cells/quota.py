"""A fixed CPU budget per local cell: its idle compute is not used by another cell, and its busy
compute is not taken by the work outside the cells.

On GPUs a cell's idle accelerators are simply idle, and the harnesses, the proxy and the
coordinator run on CPUs beside them; on one CPU box every process would otherwise share every
core, and elastic vs async vs colocate would measure nothing. Each cell gets a cgroup with a CFS
quota (`cpu.max` on cgroup v2, `cpu.cfs_quota_us` on v1), the cap, and the highest CPU weight
(`cpu.weight`, `cpu.shares`), so a busy cell gets its whole cap: otherwise each runnable process
outside the cells weighs as much as a whole cell, and training that overlapped a rollout ran at
as little as 358 tokens/s per cell against ~900 in colocate (`micro_step` events). Where no
writable cgroup exists (not root, a read-only hierarchy) the cell is pinned with
`sched_setaffinity` to its own cores instead — coarser (whole cores), and said once in the run's
summary.

A cell's cap holds from the moment its leader is ready (`cap`, once it said CellReady): its start
(imports, the model's build, the engines' start) is no part of what the cap models, and under it a
replay on one cell of 2 ranks took 29.5 s to start (`run_start`) instead of 13.2 s.
"""

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from gyre.common.wait import wait_until

log = logging.getLogger(__name__)
CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000
WEIGHT_V2, SHARES_V1 = 10_000, 262_144
"""The kernels' maxima (the default is 100 and 1024): a cell outweighs any runnable processes
outside the cells, which then share what the cells' caps leave."""


@dataclass(frozen=True)
class CpuQuota:
    """How a cell's processes are held to `cpus` CPUs."""

    name: str
    cpus: float
    mechanism: str
    """"cgroup_v2", "cgroup_v1", "affinity" or "none"."""
    path: str = ""
    """The cgroup directory (cgroup mechanisms) or the cores (affinity), for the summary."""

    def add(self, pid: int) -> None:
        """Put process `pid` under the quota (its children started later inherit it)."""
        if self.mechanism.startswith("cgroup"):
            Path(self.path, "cgroup.procs").write_text(str(pid))
        elif self.mechanism == "affinity":
            os.sched_setaffinity(pid, {int(c) for c in self.path.split(",")})

    def cap(self) -> None:
        """Hold the processes to `cpus` CPUs from now (cgroups; pinned cores hold from `add`)."""
        if self.mechanism == "cgroup_v2":
            Path(self.path, "cpu.max").write_text(f"{quota_us(self.cpus)} {PERIOD_US}")
        elif self.mechanism == "cgroup_v1":
            Path(self.path, "cpu.cfs_quota_us").write_text(str(quota_us(self.cpus)))

    def remove(self, timeout_s: float = 10.0) -> None:
        """Delete the cgroup once its processes have exited (a child may take a moment to go)."""
        if not self.mechanism.startswith("cgroup"):
            return
        error = None

        def removed() -> bool:
            nonlocal error
            try:
                os.rmdir(self.path)
            except FileNotFoundError:
                pass
            except OSError as e:
                error = e
                return False
            return True

        if not wait_until(removed, timeout_s, interval_s=0.1):
            log.warning("could not remove cgroup %s: %s", self.path, error)


def quota_us(cpus: float) -> int:
    """CFS quota per period for `cpus` CPUs (at least 1 ms, the kernel's minimum)."""
    return max(1000, round(cpus * PERIOD_US))


def make_quota(
    name: str, cpus: float, index: int, root: Path = CGROUP_ROOT, top_weight: bool = True, capped: bool = True
) -> CpuQuota:
    """A quota of `cpus` CPUs named `name` (the `index`-th cell picks its cores for the fallback);
    `top_weight=False` keeps the kernel's default weight (a harness sandbox must not outweigh the
    cells); `capped=False` leaves the cgroup uncapped until `cap`."""
    if (root / "cgroup.controllers").exists():  # v2: one unified hierarchy
        path = root / name
        try:
            path.mkdir(exist_ok=True)
            if top_weight:
                (path / "cpu.weight").write_text(str(WEIGHT_V2))
            quota = CpuQuota(name, cpus, "cgroup_v2", str(path))
            if capped:
                quota.cap()
            return quota
        except OSError as e:
            log.warning("cgroup v2 quota for %s failed (%s)", name, e)
    elif (root / "cpu" / "cpu.cfs_quota_us").exists():
        path = root / "cpu" / name
        try:
            path.mkdir(exist_ok=True)
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            if top_weight:
                (path / "cpu.shares").write_text(str(SHARES_V1))
            quota = CpuQuota(name, cpus, "cgroup_v1", str(path))
            if capped:
                quota.cap()
            return quota
        except OSError as e:
            log.warning("cgroup v1 quota for %s failed (%s)", name, e)
    cores = sorted(os.sched_getaffinity(0))
    n = max(1, round(cpus))
    mine = [cores[(index * n + i) % len(cores)] for i in range(n)]
    log.warning("no writable cgroup: cell %s pinned to cores %s instead of a %.2f-CPU quota", name, mine, cpus)
    return CpuQuota(name, cpus, "affinity", ",".join(map(str, mine)))
