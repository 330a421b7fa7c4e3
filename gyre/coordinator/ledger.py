"""The execution ledger: one durable JSON line per execution state change (append-only, fsynced).

    queued -> running -> finished | timed_out | excluded(reason) -> trained(step)

Resume, metrics and the run's summary read it back. Each line is written with one `os.write` and
fsynced before the coordinator acts on the change, so a SIGKILL loses nothing already acted on;
a torn last line (the machine died mid-write) is skipped on reading, never fatal.
"""

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gyre.common import jsonio
from gyre.records.io import fsync_dir
from gyre.trajectory.rewards import HARNESS_OUTCOMES, LEDGER_STATES

ENDS = (*HARNESS_OUTCOMES, "excluded")
"""The states that end a rollout; an execution's first one is its outcome."""


@dataclass(frozen=True)
class LedgerEntry:
    """One state change of one execution."""

    execution_id: str
    state: str
    t: float
    group: int = -1
    """Group number (its step is group // groups_per_step)."""
    task_id: str = ""
    step: int | None = None
    """trained: the optimizer step that trained it."""
    reason: str = ""
    """excluded: why (evaluator_error, harness_failed, no_model_calls, uniform_group, ...)."""
    score: float | None = None
    duration_s: float | None = None
    exit_code: int | None = None
    """The harness's exit status (an outcome's entry; negative: killed by that signal)."""
    metrics: dict[str, float] | None = None
    """Named numbers the evaluator reported beside the score (a Harbor reward.json's other keys)."""
    tokens_kept: int | None = None
    """queued, reason continued: prompt and output tokens of its calls before the break, not generated again."""


@dataclass
class LedgerView:
    """The latest state of every execution, as read back from the ledger."""

    entries: dict[str, LedgerEntry] = field(default_factory=dict)
    """execution id -> its latest entry."""
    history: dict[str, list[LedgerEntry]] = field(default_factory=dict)
    num_torn: int = 0

    def outcome(self, execution_id: str) -> LedgerEntry | None:
        """How its rollout ended (the first finished/timed_out/excluded entry), if it did; a later
        `excluded` says why it was then left out of training (uniform group, stale, ...)."""
        return next((e for e in self.history.get(execution_id, []) if e.state in ENDS), None)

    def trained_step(self, execution_id: str) -> int | None:
        """The step it was trained at (the latest, if a resume re-trained it)."""
        return next((e.step for e in reversed(self.history.get(execution_id, [])) if e.state == "trained"), None)

    def counts(self) -> Counter:
        """Executions by rollout outcome, `trained`, and every exclusion by `excluded/<reason>`."""
        c = Counter()
        for eid, entries in self.history.items():
            o = self.outcome(eid)
            c[o.state if o else "unfinished"] += 1
            c["trained"] += any(e.state == "trained" for e in entries)
            for e in entries:
                if e.state == "excluded":
                    c[f"excluded/{e.reason}"] += 1
        return c


class ExecutionLedger:
    """Appends entries to `path` (created with its directory entry fsynced)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        new = not self.path.exists()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if new:
            fsync_dir(self.path.parent)

    def append(self, entry: LedgerEntry) -> None:
        if entry.state not in LEDGER_STATES:
            raise ValueError(f"ledger state {entry.state!r} is not one of {', '.join(LEDGER_STATES)}")
        line = jsonio.dumps({k: v for k, v in asdict(entry).items() if v not in (None, "", -1)}) + "\n"
        os.write(self._fd, line.encode())
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def read_ledger(path: str | os.PathLike) -> LedgerView:
    """Every entry of the ledger at `path` (missing file: empty); torn lines are counted and skipped."""
    view = LedgerView()
    p = Path(path)
    if not p.exists():
        return view
    for line in p.read_bytes().splitlines():
        try:
            entry = LedgerEntry(**jsonio.loads(line))
        except (ValueError, TypeError):
            view.num_torn += 1
            continue
        view.entries[entry.execution_id] = entry
        view.history.setdefault(entry.execution_id, []).append(entry)
    return view
