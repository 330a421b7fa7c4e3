"""Executions as the proxy knows them: credential, record file, call numbering, turn memory.

Each sandbox gets its own key from the admin API; the key is the only thing that names an
execution on the harness side, so a harness can only ever add records to its own file. Revoked or
unknown keys answer 401. Records are appended durably (one line + fsync per call, off the event
loop), numbered in the order requests arrive.
"""

import asyncio
import hashlib
import json
import re
import secrets
import time
from collections import deque
from pathlib import Path

from gyre.errors import GyreError
from gyre.proxy.render import TurnMemory
from gyre.records.io import RecordWriter
from gyre.records.record import CallRecord

_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class Execution:
    def __init__(self, execution_id: str, key: str, records_path: Path, fsync: bool):
        self.execution_id, self.key, self.records_path = execution_id, key, records_path
        self.revoked = False
        self.turns = TurnMemory()
        self.num_calls = 0
        self._writer = RecordWriter(records_path, fsync=fsync)
        self._recent: deque[str] = deque(maxlen=64)
        self._write_lock = asyncio.Lock()

    def begin_call(self) -> tuple[int, float]:
        """The next sequence number and the start time (taken together, so they agree in order)."""
        seq = self.num_calls
        self.num_calls += 1
        return seq, time.time()

    def is_retry(self, body: dict) -> bool:
        """Whether this body (ignoring `stream`) was sent before: a harness re-sending a call."""
        digest = hashlib.sha256(json.dumps({k: v for k, v in body.items() if k != "stream"}, sort_keys=True).encode()).hexdigest()
        seen = digest in self._recent
        self._recent.append(digest)
        return seen

    async def append(self, record: CallRecord) -> None:
        async with self._write_lock:  # keeps file order = completion order within the execution
            await asyncio.to_thread(self._writer.append, record)

    def close(self) -> None:
        self._writer.close()


class ExecutionRegistry:
    def __init__(self, records_dir: str, fsync: bool = True):
        self.records_dir = Path(records_dir)
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.by_id: dict[str, Execution] = {}
        self._by_key: dict[str, Execution] = {}

    def create(self, execution_id: str) -> Execution:
        """A new execution with a fresh key; its records go to `<records_dir>/<id>.jsonl`.

        Raises:
            GyreError: a malformed or already registered id.
        """
        if not isinstance(execution_id, str) or not _ID.match(execution_id):
            raise GyreError(f"execution_id must match {_ID.pattern}, got {execution_id!r}")
        if execution_id in self.by_id:
            raise GyreError(f"execution {execution_id!r} is already registered")
        ex = Execution(execution_id, "gyre-" + secrets.token_urlsafe(24), self.records_dir / f"{execution_id}.jsonl", self.fsync)
        self.by_id[execution_id] = ex
        self._by_key[ex.key] = ex
        return ex

    def revoke(self, execution_id: str) -> Execution:
        ex = self.by_id.get(execution_id)
        if ex is None:
            raise GyreError(f"unknown execution {execution_id!r}")
        ex.revoked = True
        self._by_key.pop(ex.key, None)
        return ex

    def lookup(self, key: str | None) -> Execution | None:
        ex = self._by_key.get(key or "")
        return ex if ex is not None and not ex.revoked else None

    def close(self) -> None:
        for ex in self.by_id.values():
            ex.close()
