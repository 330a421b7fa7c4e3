"""Harbor's paths without a container: a bubblewrap root that has the workdir, /tests and /logs.

    root:     / = fresh tmpfs with the allowlist's system folders and the harness's install read-only
              (gyre/harness/roots.py), fresh /tmp /dev /proc, WS at the workdir, the private HOME at
              its own path, the task folder masked (tests/ and solution/ unseen where an install
              holds it), /tests, /logs and /solution bound from the environment's host folders

`--ro-bind / /` cannot give these paths (it cannot create /app), hence the fresh root with the
allowed host entries bound one by one (symlinks such as /bin -> usr/bin kept as symlinks).
What is written outside the bound paths lands in the sandbox's own tmpfs, which lives as long as
its environment (gyre/harness/environment.py: the agent, the oracle and the verifier enter one).
"""

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from gyre.harness.roots import make_root_args


@dataclass(frozen=True)
class Mount:
    source: Path
    """Host path."""
    dest: str
    """Path inside the sandbox."""
    writable: bool = True


def make_contract_prefix(
    system: list[tuple[str, str | None]],
    secrets: list[tuple[str, bool]],
    mounts: list[Mount],
    cwd: str,
    hide: list[str] = (),
) -> list[str]:
    """bubblewrap argv for a sandbox with the Harbor paths (pure).

    Args:
        system: roots.list_system_root(): bound read-only, but those a contract mount starts with
            (a mount to another path than its source's).
        secrets: roots.list_secrets(), masked.
        mounts: bound in order after a fresh /tmp (a later mount may sit inside an earlier one); the
            harness's install among them, read-only at its own path.
        cwd: the working directory inside (the workdir).
        hide: host paths masked by an empty tmpfs (the task folder, from the agent).
    """
    taken = {PurePosixPath(m.dest).parts[1] for m in mounts if str(m.source) != m.dest}
    argv = ["bwrap", *make_root_args([e for e in system if e[0] not in taken], secrets, [])]
    for path in hide:
        argv += ["--tmpfs", str(path)]
    for m in mounts:
        argv += ["--bind" if m.writable else "--ro-bind", str(m.source), m.dest]
    return argv + ["--unshare-pid", "--die-with-parent", "--chdir", cwd, "--"]
