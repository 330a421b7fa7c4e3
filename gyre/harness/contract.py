"""Harbor's paths without a container: a bubblewrap root that has the workdir, /tests and /logs.

    root:     / = fresh tmpfs, host entries read-only, fresh /tmp /dev /proc, WS at the workdir,
              the private HOME at its own path, the task folder masked (tests/ and solution/ unseen),
              /tests, /logs and /solution bound from the environment's host folders

`--ro-bind / /` cannot give these paths (it cannot create /app), hence the fresh root with the
host's top-level entries bound one by one (symlinks such as /bin -> usr/bin kept as symlinks).
What is written outside the bound paths lands in the sandbox's own tmpfs, which lives as long as
its environment (gyre/harness/environment.py: the agent, the oracle and the verifier enter one).
"""

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

FRESH = ("proc", "dev", "tmp")
"""Top-level host entries the sandbox gets fresh instead of bound."""


@dataclass(frozen=True)
class Mount:
    source: Path
    """Host path."""
    dest: str
    """Path inside the sandbox."""
    writable: bool = True


def list_host_root(root: Path = Path("/")) -> list[tuple[str, str | None]]:
    """(name, symlink target or None) of each entry of the host's root directory."""
    return [(e.name, os.readlink(e.path) if e.is_symlink() else None) for e in sorted(os.scandir(root), key=str)]


def make_contract_prefix(
    host_root: list[tuple[str, str | None]], mounts: list[Mount], cwd: str, hide: list[str] = ()
) -> list[str]:
    """bubblewrap argv for a sandbox with the Harbor paths (pure).

    Args:
        host_root: list_host_root(): the entries bound read-only, but those FRESH and those a
            contract mount starts with (/app, /tests, /logs: a mount to another path than its
            source's); a mount at its own host path (the private HOME) sits inside the host's.
        mounts: bound in order, after the host entries (a later mount may sit inside an earlier one).
        cwd: the working directory inside (the workdir).
        hide: host paths masked by an empty tmpfs (the task folder, from the agent).
    """
    taken = {PurePosixPath(m.dest).parts[1] for m in mounts if str(m.source) != m.dest}
    argv = ["bwrap", "--tmpfs", "/"]
    for name, target in host_root:
        if name in FRESH or name in taken:
            continue
        argv += ["--symlink", target, f"/{name}"] if target is not None else ["--ro-bind", f"/{name}", f"/{name}"]
    argv += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    for path in hide:
        argv += ["--tmpfs", str(path)]
    for m in mounts:
        argv += ["--bind" if m.writable else "--ro-bind", str(m.source), m.dest]
    return argv + ["--unshare-pid", "--die-with-parent", "--chdir", cwd, "--"]
