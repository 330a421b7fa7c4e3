"""Executions as the proxy knows them: credential, record file, call numbering, turn memory.

Each sandbox gets its own key from the admin API; the key is the only thing that names an
execution on the harness side, so a harness can only ever add records to its own file. Revoked or
unknown keys answer 401. Records are numbered in the order requests arrive and each is written
(one line, one write) before the call is answered, so a killed proxy loses no answered call. With
`fsync_window_ms` > 0 (the default) a background group commit fsyncs the files at most that late, so
a machine crash loses at most the last window's records and no call waits for the disk; with 0
every record is fsynced (off the event loop) before its answer (see gyre.records.io).

Restarts: the records file is the durable truth of an execution, and `<id>.key` next to it holds
the SHA-256 of its key (never the key), so a proxy restarted over the same records directory
accepts the sandboxes' existing keys. The first call of an execution the process has no memory of
(one loaded at start, or re-registered over an existing records file) reads its records once:
numbering continues after the highest seq, and the turn memory is refilled from the recorded
output ids, so a continuing conversation reuses the model's exact tokens across the restart.
"""

import asyncio
import hashlib
import logging
import re
import secrets
import time
import zlib
from pathlib import Path

import numpy as np

from gyre.common.files import write_private_file
from gyre.common.run_paths import record_path
from gyre.errors import GyreError
from gyre.proxy.chat import ApiError
from gyre.proxy.conversation import ConversationCache
from gyre.proxy.render import TurnMemory, remember_records
from gyre.records.io import (
    GroupCommit,
    RecordFileError,
    RecordWriter,
    fsync_dir,
    read_records,
)
from gyre.records.record import CallRecord

log = logging.getLogger(__name__)

_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_KEY = re.compile(r"^[A-Za-z0-9._~-]{24,256}$")


def worker_of(execution_id: str, num_workers: int) -> int:
    """The proxy worker an execution is pinned to (stable across processes and restarts)."""
    return zlib.crc32(execution_id.encode()) % num_workers


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ProxyExecution:
    """One execution as the proxy serves it: its key, records file, call numbering and turn memory
    (its lifecycle is `gyre.coordinator.source.Execution`'s)."""

    def __init__(
        self,
        execution_id: str,
        key: str | None,
        digest: str,
        records_path: Path,
        fsync: bool,
        parse,
        group: GroupCommit | None = None,
    ):
        """key: None for one loaded at start (only its `digest`, the SHA-256 of the key, is kept)."""
        self.execution_id, self.key, self.digest, self.records_path = execution_id, key, digest, records_path
        self.revoked = False
        self.turns = TurnMemory()
        self.conversations = ConversationCache()
        self._restored_inputs: dict[str, np.ndarray] = {}
        """Each agent's last recorded input, read at a restart: its first call repeating it is a retry."""
        self.num_calls = 0
        self.num_inflight = 0
        """Calls of this execution being answered now (the coordinator's load signal)."""
        self._parse = parse
        self._writer = RecordWriter(records_path, fsync=fsync, group=group)  # cuts a torn tail before we read
        self._sync_each = fsync and group is None
        self._restore_pending = records_path.stat().st_size > 0
        self._restore_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()

    async def ready(self) -> None:
        """Before the first call of this process: continue numbering and turn memory from the
        records an earlier proxy process wrote (once; see module doc).

        Raises:
            ApiError: api_error when the records file is corrupt (beyond a torn last line).
        """
        if not self._restore_pending:
            return
        async with self._restore_lock:
            if not self._restore_pending:
                return
            try:
                records, _ = await asyncio.to_thread(read_records, self.records_path)
            except RecordFileError as e:
                raise ApiError(
                    "api_error", f"execution {self.execution_id}: cannot continue its records: {e}"
                ) from None
            remember_records(self.turns, records, self._parse)
            self._restored_inputs = {r.agent_id: r.input_ids for r in records}
            self._writer.continue_from(records)
            self.num_calls = max([self.num_calls] + [r.seq + 1 for r in records])
            self._restore_pending = False
            log.info(
                "execution %s: continued from %d records (next seq %d)", self.execution_id, len(records), self.num_calls
            )

    def begin_call(self) -> tuple[int, float]:
        """The next sequence number and the start time (taken together, so they agree in order)."""
        seq = self.num_calls
        self.num_calls += 1
        return seq, time.time()

    def repeats_restored(self, agent_id: str, input_ids: np.ndarray) -> bool:
        """After a restart (no snapshots yet): whether the agent's first call has the prompt of its
        last recorded call (a harness re-sending the call the old process was answering)."""
        last = self._restored_inputs.pop(agent_id, None) if self._restored_inputs else None
        return last is not None and last.size == input_ids.size and bool(np.array_equal(last, input_ids))

    async def append(self, record: CallRecord) -> None:
        if not self._sync_each:  # one write() to the page cache (~0.1 ms with the encoding): a thread hop costs more
            self._writer.append(record)
            return
        async with self._write_lock:  # keeps file order = completion order within the execution
            await asyncio.to_thread(self._writer.append, record)

    def close(self) -> None:
        self._writer.close()


class ExecutionRegistry:
    """Executions by id and by key digest; those with a `<id>.key` file in `records_dir` are known at start.

    Args:
        parse: output ids -> ParsedAssistant (the tokenizer's), to refill turn memory from records.
        worker: (this worker's index, number of workers): only executions pinned here (`worker_of`)
            are loaded or created, so each records file has one writer.
    """

    def __init__(
        self,
        records_dir: str,
        fsync: bool = True,
        parse=None,
        fsync_window_ms: float = 0.0,
        worker: tuple[int, int] = (0, 1),
    ):
        self.worker = worker
        self.records_dir = Path(records_dir)
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.fsync, self.parse = fsync, parse
        self.group = GroupCommit(fsync_window_ms / 1e3) if fsync and fsync_window_ms > 0 else None
        self.by_id: dict[str, ProxyExecution] = {}
        self._by_digest: dict[str, ProxyExecution] = {}
        for path in sorted(self.records_dir.glob("*.key")):
            digest = path.read_text().strip()
            if not (_ID.match(path.stem) and re.fullmatch(r"[0-9a-f]{64}", digest)):
                log.warning("%s: not an execution key file (ignored)", path)
            elif worker_of(path.stem, worker[1]) == worker[0]:
                self._add(path.stem, None, digest)

    def _add(self, execution_id: str, key: str | None, digest: str) -> ProxyExecution:
        ex = ProxyExecution(
            execution_id, key, digest, record_path(self.records_dir, execution_id), self.fsync, self.parse, self.group
        )
        self.by_id[execution_id] = ex
        self._by_digest[digest] = ex
        return ex

    def create(self, execution_id: str, key: str | None = None) -> ProxyExecution:
        """A new execution (a fresh key unless `key` is given: the sandbox's key after a proxy lost
        it); its records go to `<records_dir>/<id>.jsonl`, continuing an existing file. An id this
        proxy knows only from its key file (registered before a restart, its sandbox gone) takes
        the new key: the execution continues in a new sandbox.

        Raises:
            GyreError: a malformed or already registered id, one pinned to another worker, a malformed
                key or one in use.
        """
        if not isinstance(execution_id, str) or not _ID.match(execution_id):
            raise GyreError(f"execution_id must match {_ID.pattern}, got {execution_id!r}")
        known = self.by_id.get(execution_id)
        if known is not None and known.key is not None:
            raise GyreError(f"execution {execution_id!r} is already registered")
        if known is not None:  # known by its key file alone: its sandbox is gone, a continued execution's is new
            self._by_digest.pop(known.digest, None)
            known.close()
        pinned = worker_of(execution_id, self.worker[1])
        if pinned != self.worker[0]:
            raise GyreError(
                f"execution {execution_id!r} is pinned to proxy worker {pinned}, this is worker {self.worker[0]}"
            )
        if key is not None and (not isinstance(key, str) or not _KEY.match(key)):
            raise GyreError(f"api_key must match {_KEY.pattern} (24+ URL-safe characters)")
        key = key or "gyre-" + secrets.token_urlsafe(24)
        digest = key_digest(key)
        if digest in self._by_digest:
            raise GyreError("api_key is already in use by another execution")
        write_private_file(str(self.records_dir / f"{execution_id}.key"), digest + "\n", fsync=self.fsync)
        if self.fsync:  # the key must survive a crash as long as the sandbox holding it does
            fsync_dir(self.records_dir)
        return self._add(execution_id, key, digest)

    def revoke(self, execution_id: str) -> ProxyExecution:
        ex = self.by_id.get(execution_id)
        if ex is None:
            raise GyreError(f"unknown execution {execution_id!r}")
        ex.revoked = True
        self._by_digest.pop(ex.digest, None)
        (self.records_dir / f"{execution_id}.key").unlink(missing_ok=True)
        return ex

    def lookup(self, key: str | None) -> ProxyExecution | None:
        ex = self._by_digest.get(key_digest(key or ""))
        return ex if ex is not None and not ex.revoked else None

    def close(self) -> None:
        if self.group is not None:
            self.group.close()  # its pending fsyncs run in parallel; closing writers then has none left
        for ex in self.by_id.values():
            ex.close()
