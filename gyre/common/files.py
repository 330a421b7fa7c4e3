"""Files other processes read while we write them: every file or folder Gyre writes for a reader
appears whole under its name in one rename (here, the one place that renames), never half written.

    with atomic_path(path) as tmp: write tmp (a file or a folder)   ─> renamed onto `path` at the end
    publish(tmp, final)                                              ─> the rename itself (fsync first)
"""

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gyre.common import jsonio


def publish(tmp: str | os.PathLike, final: str | os.PathLike, fsync: bool = False) -> None:
    """Make fully written `tmp` (a file or a folder) visible as `final` in one rename (over a file
    already there; a folder must not exist). With `fsync` its content is on disk first."""
    if fsync:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, final)


@contextmanager
def atomic_path(path: str | os.PathLike, fsync: bool = False) -> Iterator[Path]:
    """A hidden, unique sibling of `path` to write a file or a folder into; published onto `path`
    when the block ends without an error, removed when it raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        publish(tmp, path, fsync)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | os.PathLike, data: str | bytes, fsync: bool = False, mode: int = 0o644) -> None:
    """Write `data` to `path` atomically (a reader never sees half a file), with permissions `mode`."""
    with atomic_path(path, fsync) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            if fsync:
                f.flush()


def write_private_file(path: str | os.PathLike, data: str | bytes, fsync: bool = False) -> None:
    """`write_atomic`, owner-only: it may carry a token."""
    write_atomic(path, data, fsync, mode=0o600)


def write_child_config(path: str | os.PathLike, config: dict) -> str:
    """Hand a child process its config as a private JSON file at `path` and return the path, which
    goes on its command line instead of the config: argv is world-readable (`ps`, /proc/PID/cmdline)
    on a shared node, and a config may carry a token."""
    write_private_file(path, jsonio.dumps(config))
    return os.fspath(path)


def read_child_config(path: str | os.PathLike) -> dict:
    """The config `write_child_config` wrote (the child's side)."""
    return jsonio.loads(Path(path).read_text())
