"""Files other processes read while we write them: owner-only, atomic."""

import os


def write_private_file(path: str | os.PathLike, data: str | bytes, fsync: bool = False) -> None:
    """Write `data` owner-only, atomically (a reader never sees half a file): it may carry a token.
    With `fsync` the content is on disk before the rename (the directory entry is the caller's)."""
    tmp = f"{os.fspath(path)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
