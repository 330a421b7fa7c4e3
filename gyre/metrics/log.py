"""The run's events file: appending events (every process) and reading them back (every view).

One file, `run_dir/events.jsonl`, for all processes of a run (coordinator, proxy, cell leaders):
each opens it O_APPEND and writes each event as one whole line with one `os.write`, so the kernel
places every line at the end in one piece and lines of different processes never interleave (true
of local file systems; on NFS/Lustre O_APPEND is not atomic across hosts: give each host its own
file there). A killed process never tears a line; a full disk can (a short write), so readers skip
an unparseable line wherever it is and count it, and a torn *last* line is what a crash leaves.

`emit` never raises: observability must not stop a run. A failed write (full disk, unwritable
directory, an event that does not encode) is logged once and counted in `num_dropped`.
"""

import logging
import os
from collections.abc import Iterator
from pathlib import Path

from gyre.common import jsonio
from gyre.common.run_paths import RunPaths
from gyre.metrics.events import Event, EventError, decode_event, encode_event
from gyre.records.io import ReadStats

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 4 << 20


class EventLog:
    """Appends this process's events to the run's events file; thread-safe (one write per event).

    Usage: `events = EventLog(run_dir)`, `events.emit(ModelCall(...))`, `events.close()`.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.path = RunPaths(run_dir).events  # the run's source of truth: every process and reader finds it there
        self.num_written = 0
        self.num_dropped = 0
        """Events lost to a failed write or encoding; the first failure is logged, the rest only counted."""
        self._fd: int | None = None
        self._logged = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            log.warning("metrics: cannot open %s (%s); events are counted, not written", self.path, e)
            self._logged = True

    def emit(self, event: Event) -> None:
        """Append one event; never raises (a failure is counted in `num_dropped`)."""
        try:
            line = encode_event(event)
            if os.write(self._fd, line) != len(line):
                raise OSError(f"short write of {len(line)} bytes (disk full?)")
            self.num_written += 1
        except Exception as e:
            self.num_dropped += 1
            if not self._logged:
                self._logged = True
                log.warning("metrics: dropping events to %s: %r (logged once, counted)", self.path, e)

    def close(self) -> None:
        if self.num_dropped:
            log.warning(
                "metrics: %d of %d events to %s were dropped",
                self.num_dropped,
                self.num_dropped + self.num_written,
                self.path,
            )
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EventTail:
    """Reads an events file incrementally, as other processes append to it.

    Each `read_new()` returns the events of the complete lines added since the last call; a
    partial last line waits for its end. A missing file reads as empty.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.stats = ReadStats()
        self._offset = 0
        self._partial = b""
        self._line_no = 0

    def read_new(self, max_bytes: int = READ_CHUNK_BYTES) -> list[Event]:
        """Events of the complete lines appended since the last call (at most about `max_bytes` of them)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(max_bytes)
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        self.stats.num_bytes = self._offset
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        self.stats.num_torn = 1 if self._partial else 0
        events = []
        for raw in lines:
            self._line_no += 1
            try:
                events.append(decode_event(jsonio.loads(raw)))
            except (ValueError, EventError, AttributeError) as e:
                self.stats.invalid.append((self._line_no, f"{type(e).__name__}: {e}"[:200]))
        self.stats.num_read += len(events)
        return events

    def read_all(self) -> Iterator[Event]:
        """Every event from the current offset to the end of the file, chunk by chunk."""
        while batch := self.read_new():
            yield from batch
        # A partial last line is torn only if it does not parse: a final line may lack just its newline.
        if self._partial:
            try:
                event = decode_event(jsonio.loads(self._partial))
            except (ValueError, EventError, AttributeError):
                return
            self._partial, self.stats.num_torn = b"", 0
            self.stats.num_read += 1
            yield event


def read_events(path: str | os.PathLike) -> tuple[list[Event], ReadStats]:
    """Every event in an events file, skipping (and counting) a torn last line and invalid lines.

    Returns:
        (events in file order, ReadStats)
    """
    tail = EventTail(path)
    events = list(tail.read_all())
    if tail.stats.num_torn:
        log.warning("metrics: %s ends in a torn line (a crash mid-write); skipped", path)
    if tail.stats.invalid:
        log.warning(
            "metrics: %s has %d invalid lines (first: line %d, %s)",
            path,
            len(tail.stats.invalid),
            *tail.stats.invalid[0],
        )
    return events, tail.stats
