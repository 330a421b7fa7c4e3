"""Append-only storage of an execution's records: one JSON line per call, token arrays in base64.

Format (version 1), one object per line:
    {"v": 1, <scalar fields of CallRecord>, "versions": [[start, end, version], ...],
     "input_base": <call_id or null>, "input_prefix": n, "input_suffix": <b64 int32>,
     "output": <b64 int32>, "logprobs": <b64 float32>}
A call's input is stored as the first n tokens of an earlier record's input+output (`input_base`,
normally the same agent's previous call) plus the new suffix: a harness re-sends its whole context
each call, so storing inputs whole would cost O(calls x context) (tens of millions of tokens for a
700K-token execution); the delta keeps files near the execution's unique tokens.

Crash tolerance: each record is one `write` of one whole line to an O_APPEND file, so a killed
*process* (SIGKILL) never tears a line: the kernel holds it in the page cache. A *machine* crash
keeps what was fsynced. A writer either fsyncs every record before `append` returns (`fsync=True`,
durable per call), or hands its file to a `GroupCommit`, which fsyncs every file with new lines
every `window_s` (a line is durable within the window plus the fsyncs under way): a machine
crash then loses at most the last window of records, and the caller never waits on a disk flush
(an fsync costs 5-15 ms on a shared disk, more than everything else a proxy call does). The reader treats an
unparseable *last* line as torn (skipped, counted, warned); a writer reopening a file cuts such a
tail off first, and a failed write is cut back off, so a torn line can only ever be the last one
and an unparseable line elsewhere is real corruption.
"""

import base64
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gyre.common import jsonio
from gyre.errors import GyreError
from gyre.records.record import CallRecord, RecordError, VersionSpan

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MIN_SHARED_PREFIX = 64
"""Shorter shared prefixes are stored inline: a base reference would save less than it costs."""
_SCALARS = (
    "execution_id",
    "call_id",
    "seq",
    "agent_id",
    "parent_agent_id",
    "kind_hint",
    "finish_reason",
    "engine_id",
    "cell_id",
    "rerouted",
    "num_migrated_tokens",
    "num_recomputed_tokens",
    "started_at",
    "finished_at",
    "is_retry",
    "hints",
)


class RecordFileError(GyreError):
    """A records file that cannot be read as a whole (corruption other than a torn last line)."""


@dataclass
class ReadStats:
    """What reading an append-only JSON-lines file (records, events) found besides its items."""

    num_read: int = 0
    """Items read (records or events)."""
    num_torn: int = 0
    """1 if the file ends in a partial line (a crash mid-write, or a line still being written): skipped."""
    invalid: list[tuple[int, str]] = field(default_factory=list)
    """(line number, reason) of complete lines whose item breaks the contract (skipped)."""
    num_bytes: int = 0


def _b64(a: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=dtype).tobytes()).decode("ascii")


def _unb64(s: str, dtype: type) -> np.ndarray:
    raw = base64.b64decode(s, validate=True)
    return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype, copy=False)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D arrays (vectorised)."""
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _prefix_over(a: np.ndarray, parts: tuple[np.ndarray, ...]) -> int:
    """Common prefix length of `a` and the concatenation of `parts` (without concatenating them)."""
    n = 0
    for p in parts:
        m = common_prefix_len(a[n:], p)
        n += m
        if m < p.size:
            break
    return n


def encode_record(
    record: CallRecord, base: tuple[str, np.ndarray] | tuple[str, np.ndarray, np.ndarray] | None = None
) -> bytes:
    """One JSON line (UTF-8, with trailing newline) for `record`; `base` = (call_id, its
    input+output, as one array or as input and output) to delta against."""
    obj = {"v": FORMAT_VERSION, **{k: getattr(record, k) for k in _SCALARS}}
    obj["versions"] = [[s.start, s.end, s.version] for s in record.version_spans]
    prefix = _prefix_over(record.input_ids, base[1:]) if base is not None else 0
    if prefix < MIN_SHARED_PREFIX:
        base, prefix = None, 0
    obj["input_base"] = base[0] if base is not None else None
    obj["input_prefix"] = prefix
    obj["input_suffix"] = _b64(record.input_ids[prefix:], "<i4")
    obj["output"] = _b64(record.output_ids, "<i4")
    obj["logprobs"] = _b64(record.logprobs, "<f4")
    return jsonio.dumpb(obj) + b"\n"


def decode_record(obj: dict, sequences: dict[str, tuple[np.ndarray, np.ndarray]]) -> CallRecord:
    """The record of one parsed line; `sequences` maps earlier call ids to their (input, output).

    The line's own token arrays are added to `sequences` as soon as they decode, even if the record
    then breaks the contract, so later records that delta against it stay readable.

    Raises:
        RecordError: a missing or malformed field, an unknown base, or a record breaking the contract.
    """
    try:
        if obj.get("v") != FORMAT_VERSION:
            raise RecordError(f"format version {obj.get('v')!r}, this reader knows {FORMAT_VERSION}")
        input_ids = _decode_input(obj, sequences)
        output_ids = _unb64(obj["output"], np.int32)
        sequences[str(obj["call_id"])] = (input_ids, output_ids)
        spans = tuple(VersionSpan(int(a), int(b), int(v)) for a, b, v in obj["versions"])
        return CallRecord(
            **{k: obj[k] for k in _SCALARS},
            input_ids=input_ids,
            output_ids=output_ids,
            logprobs=_unb64(obj["logprobs"], np.float32),
            version_spans=spans,
        )
    except KeyError as e:
        raise RecordError(f"missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, RecordError):
            raise
        raise RecordError(f"malformed field: {e}") from None


def _decode_input(obj: dict, sequences: dict[str, tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    suffix = _unb64(obj["input_suffix"], np.int32)
    if obj["input_base"] is None:
        return suffix
    if obj["input_base"] not in sequences:
        raise RecordError(f"input_base {obj['input_base']!r} is not an earlier record")
    b_in, b_out = sequences[obj["input_base"]]
    n = int(obj["input_prefix"])
    if not 0 < n <= b_in.size + b_out.size:
        raise RecordError(f"input_prefix {n} outside its base of {b_in.size + b_out.size} tokens")
    head = b_in[:n] if n <= b_in.size else np.concatenate((b_in, b_out[: n - b_in.size]))
    return np.concatenate((head, suffix))


class RecordWriter:
    """Appends one execution's records to `path`; thread-safe; durability per the module doc.

    Usage: `with RecordWriter(path) as w: w.append(record)`.
    """

    def __init__(self, path: str | os.PathLike, *, fsync: bool = True, group: "GroupCommit | None" = None):
        """fsync: fsync each record inside `append`; group: fsync in its batches instead (`fsync` ignored)."""
        self.path = Path(path)
        self._fsync = fsync and group is None
        self._group = group
        self._lock = threading.Lock()
        self._last_by_agent: dict[str, tuple[str, np.ndarray, np.ndarray]] = {}
        """Agent -> (call id, input, output) of its last record, the base of its next one."""
        self._execution_id: str | None = None
        self._unsynced = False
        created = not self.path.exists()
        self._file = open(self.path, "ab+")
        self.num_truncated_bytes = self._cut_torn_tail()
        self._file.flush()
        self._size = self._file.seek(0, os.SEEK_END)
        if created and (fsync or group is not None):
            fsync_dir(self.path.parent)

    def _cut_torn_tail(self) -> int:
        """Remove a last line torn by a crash, so that only a new crash can tear the file."""
        size = self._file.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        self._file.seek(size - 1)
        ends_with_newline = self._file.read(1) == b"\n"
        end = size - 1 if ends_with_newline else size
        start, chunk = end, 1 << 16
        while start > 0:
            lo = max(0, start - chunk)
            self._file.seek(lo)
            cut = self._file.read(start - lo).rfind(b"\n")
            if cut >= 0:
                start = lo + cut + 1
                break
            start = lo
        self._file.seek(start)
        try:
            jsonio.loads(self._file.read(end - start))
        except ValueError:
            self._file.truncate(start)
            log.warning("%s: cut a torn last line of %d bytes left by a crash", self.path, size - start)
            return size - start
        if not ends_with_newline:
            self._file.write(b"\n")
        return 0

    def continue_from(self, records: list[CallRecord]) -> None:
        """Delta-encode after `records` (this file's, as read back): a writer opened by a new process
        otherwise stores each agent's next input whole, one full copy of a long context per agent."""
        with self._lock:
            for record in records:
                if self._execution_id is None:
                    self._execution_id = record.execution_id
                self._last_by_agent[record.agent_id] = (record.call_id, record.input_ids, record.output_ids)

    def append(self, record: CallRecord) -> None:
        """Write `record` as one line (fsynced first if `fsync`); raises RecordError for a record of
        another file's execution, OSError if the disk refuses (the partial line is cut back off)."""
        with self._lock:
            if self._execution_id is None:
                self._execution_id = record.execution_id
            elif record.execution_id != self._execution_id:
                raise RecordError(
                    f"{self.path} holds execution {self._execution_id!r}; got a record of {record.execution_id!r}"
                )
            base = self._last_by_agent.get(record.agent_id)
            self._write(encode_record(record, base))
            if self._fsync:
                os.fsync(self._file.fileno())
            self._last_by_agent[record.agent_id] = (record.call_id, record.input_ids, record.output_ids)
            first_unsynced = self._group is not None and not self._unsynced
            self._unsynced = self._group is not None
        if first_unsynced:
            self._group.mark(self)

    def _write(self, line: bytes) -> None:
        """One line at the end of the file, whole or not at all (a failed write is truncated away)."""
        fd, view, done = self._file.fileno(), memoryview(line), 0
        try:
            while done < len(line):
                done += os.write(fd, view[done:])
        except OSError:
            os.ftruncate(fd, self._size)
            raise
        self._size += len(line)

    def sync(self) -> None:
        """fsync what was written so far. The fsync runs on a duplicate descriptor outside the lock,
        so appends never wait for the disk and a concurrent close cannot pull the file away."""
        with self._lock:
            if self._file.closed or not self._unsynced:
                return
            self._unsynced = False
            fd = os.dup(self._file.fileno())
        try:
            os.fsync(fd)
        except OSError:
            with self._lock:
                self._unsynced = True
            raise
        finally:
            os.close(fd)

    def close(self) -> None:
        """Close the file, fsyncing first what a group commit has not yet."""
        if self._group is not None:
            self.sync()
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class GroupCommit:
    """A background thread that fsyncs record files in batches (see the module doc).

    A writer marks itself on its first unsynced line (a dict insert: no thread wake-up on the
    caller's path); every `window_s` the thread fsyncs the marked files in parallel (concurrent
    fsyncs share the file system's journal commits: 64 files take ~40 ms, one after another
    ~300 ms). A line is thus durable at most `window_s` plus two batches' fsyncs (the one under way
    when it was written, and its own) after its write. An fsync that fails is logged and counted,
    and its file stays marked for the next batch.
    """

    def __init__(self, window_s: float, max_parallel: int = 8):
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.num_batches = self.num_syncs = self.num_errors = 0
        self._pending: dict[int, RecordWriter] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="gyre-fsync")
        self._thread = threading.Thread(target=self._run, name="gyre-group-commit", daemon=True)
        self._thread.start()

    def mark(self, writer: RecordWriter) -> None:
        with self._lock:
            self._pending[id(writer)] = writer

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(self.window_s)
            with self._lock:
                batch, self._pending = list(self._pending.values()), {}
            if batch:
                self._sync(batch, retry=not stopping)
            if stopping:
                return

    def _sync(self, batch: list[RecordWriter], retry: bool) -> None:
        for writer, error in zip(batch, self._pool.map(_sync_error, batch)):
            if error is not None:
                self.num_errors += 1
                log.error(
                    "%s: fsync failed (%r)%s", writer.path, error, "; retrying in the next batch" if retry else ""
                )
                if retry:
                    self.mark(writer)
        self.num_batches += 1
        self.num_syncs += len(batch)

    def close(self) -> None:
        """Fsync what is pending (without waiting for the window) and stop the thread."""
        self._stop.set()
        self._thread.join()
        self._pool.shutdown()


def _sync_error(writer: RecordWriter) -> OSError | None:
    try:
        writer.sync()
    except OSError as e:
        return e
    return None


def fsync_dir(path: Path) -> None:
    """Make a new file's directory entry durable (the file's own fsync does not cover it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def has_records(path: str | os.PathLike | None) -> bool:
    """Whether the proxy recorded at least one model call in `path` (None: no records file known)."""
    return path is not None and Path(path).is_file() and Path(path).stat().st_size > 0


def read_records(path: str | os.PathLike) -> tuple[list[CallRecord], ReadStats]:
    """All readable records of a file, in file order, and what was skipped.

    Returns:
        (records, stats): a torn last line is skipped and counted in stats.num_torn (with a
        warning); complete lines whose record is invalid are skipped and listed in stats.invalid.
    Raises:
        RecordFileError: a line other than the last cannot be parsed (corruption, not a crash).
    """
    data = Path(path).read_bytes()
    stats = ReadStats(num_bytes=len(data))
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    records: list[CallRecord] = []
    sequences: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for i, line in enumerate(lines):
        try:
            obj = jsonio.loads(line)
            if not isinstance(obj, dict):
                raise ValueError(f"a JSON {type(obj).__name__}, not an object")
        except ValueError as e:
            if i == len(lines) - 1:
                stats.num_torn = 1
                log.warning("%s: skipped a torn last line (%d bytes): %s", path, len(line), e)
                break
            raise RecordFileError(
                f"{path}: line {i + 1} of {len(lines)} is unreadable ({e}); only the last line can be torn by a crash"
            ) from None
        try:
            record = decode_record(obj, sequences)
        except RecordError as e:
            stats.invalid.append((i + 1, str(e)))
            log.warning("%s: line %d skipped: %s", path, i + 1, e)
            continue
        records.append(record)
    stats.num_read = len(records)
    return records, stats
