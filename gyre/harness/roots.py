"""What a sandbox's root holds: an allowlist, so an agent reads only what it must.

    system     /usr /bin /sbin /lib* /etc of the host, read-only (symlinks such as /bin -> usr/bin
               kept as symlinks), /etc's secrets masked (SECRETS)
    installs   the harness's own install, read-only at its host paths: this Python's prefixes, the
               gyre package and its config tree (gyre.common imports it; not the source tree: no
               tests, task sets or run directories), the
               harness binary's install and its interpreter's (a venv, an npm prefix), wherever they
               live (a checkout under /tmp, node-local scratch)
    execution  the workspace and the private HOME, read-write (the callers bind them)

Everything else is absent: home folders, /root, other executions, the run's records, the task set
(but what the task gives the agent), /run's sockets. Writes outside the bound paths fail (JSON
tasks: the root is remounted read-only) or land in the sandbox's own tmpfs (Harbor tasks).
"""

import glob
import os
import shutil
import sys
from pathlib import Path

import gyre
from gyre.common import CONF_DIR

SYSTEM = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
"""Top-level host entries every sandbox gets read-only."""
SECRETS = (
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/ssh/ssh_host_*_key",
    "/etc/ssl/private",
    "/etc/munge",
    "/etc/slurm/slurmdbd.conf",
)
"""Globs of /etc entries masked: password hashes, host keys, TLS keys, Slurm's munge key and DB password."""
_SYSTEM_PATHS = tuple(Path("/", name) for name in SYSTEM)


def list_system_root(root: Path = Path("/")) -> list[tuple[str, str | None]]:
    """(name, symlink target or None) of each SYSTEM entry the host's root has."""
    return [(n, os.readlink(root / n) if (root / n).is_symlink() else None) for n in SYSTEM if (root / n).exists()]


def list_secrets() -> list[tuple[str, bool]]:
    """(path, whether a folder) of each of the SECRETS present on this host."""
    return sorted((p, os.path.isdir(p)) for pattern in SECRETS for p in glob.glob(pattern))


def list_root(argv: list[str], env: dict[str, str] | None = None) -> list[str]:
    """make_root_args of this host for the harness command `argv`."""
    return make_root_args(list_system_root(), list_secrets(), harness_installs(argv, env))


def make_root_args(
    system: list[tuple[str, str | None]], secrets: list[tuple[str, bool]], readonly: list[Path]
) -> list[str]:
    """bubblewrap args of the allowlist root with a fresh /dev /proc /tmp, before its writable binds (pure).

    Args:
        system: list_system_root().
        secrets: list_secrets(): masked, a file by /dev/null, a folder by an empty tmpfs.
        readonly: installs bound read-only at their own paths.
    """
    argv = ["--tmpfs", "/"]
    for name, target in system:
        argv += ["--symlink", target, f"/{name}"] if target is not None else ["--ro-bind", f"/{name}", f"/{name}"]
    for path, is_dir in secrets:
        argv += ["--tmpfs", path] if is_dir else ["--ro-bind", "/dev/null", path]
    argv += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]  # before the installs: some live in /tmp
    for path in readonly:
        argv += ["--ro-bind", str(path), str(path)]
    return argv


def install_root(path: Path) -> Path:
    """The install that holds a program (pure): the folder holding its node_modules, else the prefix
    of its bin/ (a venv), else its own folder; never a home folder itself, whose other files are
    not the harness's: then only the program."""
    parts = path.parts
    if "node_modules" in parts:
        root = Path(*parts[: parts.index("node_modules")])
    elif path.parent.name == "bin":
        root = path.parent.parent
    else:
        root = path.parent
    homes = {Path("/"), Path("/root"), Path("/home"), Path.home()}
    return path if root in homes or root.parent == Path("/home") else root


def _interpreter(program: Path) -> str | None:
    """The interpreter a script's `#!` line names (`/usr/bin/env node`: node), or None."""
    try:
        with open(program, "rb") as f:
            line = f.readline(256)
    except OSError:
        return None
    words = line[2:].decode(errors="replace").split() if line.startswith(b"#!") else []
    if words and Path(words[0]).name == "env":
        words = [w for w in words[1:] if not w.startswith("-")]
    return words[0] if words else None


def program_installs(program: str, path: str | None = None) -> set[Path]:
    """The installs a program runs from: its own (as named and resolved) and its interpreter's."""
    found = shutil.which(program, path=path)
    if found is None:
        return set()
    named, real = Path(os.path.abspath(found)), Path(os.path.realpath(found))
    installs = {install_root(named), install_root(real)}
    interpreter = _interpreter(real)
    if interpreter is not None and interpreter != program:
        installs |= program_installs(interpreter, path)
    return installs


def harness_installs(argv: list[str], env: dict[str, str] | None = None) -> list[Path]:
    """The host folders a harness command needs beyond the system ones: this Python's (the
    coordinator's tools run in the sandbox with it), the gyre package, the program's install, and
    the script its first argument names by an absolute path (`python /x/agent.py`), that file only.
    Nested and system paths are dropped; each is bound at its own path."""
    # the config tree where it is, not where a link to it is (a checkout's gyre/conf -> ../conf)
    wanted = {Path(sys.prefix), Path(sys.base_prefix), Path(gyre.__file__).resolve().parent, Path(CONF_DIR).resolve()}
    wanted |= program_installs(sys.executable)
    if argv:
        wanted |= program_installs(argv[0], (env or os.environ).get("PATH"))
        if len(argv) > 1 and os.path.isabs(argv[1]) and os.path.isfile(argv[1]):  # `python /x/agent.py`
            wanted.add(Path(argv[1]))
    wanted = {Path(os.path.abspath(p)) for p in wanted}
    keep = {p for p in wanted if not any(p == s or s in p.parents for s in _SYSTEM_PATHS) and p != Path("/")}
    return sorted(p for p in keep if not any(q != p and q in p.parents for q in keep))
