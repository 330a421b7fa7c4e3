"""Which cell computes which micro-step of the current optimizer step (pure, no I/O).

Cells claim the lowest pending micro-step; a cell that leaves or dies gives its claims back, and
they are computed again by whoever claims next. Completion by a cell that no longer holds the
claim (it was presumed dead) is refused, so each micro-step counts exactly once.
"""

from dataclasses import dataclass, field

PENDING = None


@dataclass
class MicroStepLedger:
    num_microsteps: int
    claims: dict[int, str] = field(default_factory=dict)
    """Micro-step index -> cell currently computing it."""
    done_by: dict[int, str] = field(default_factory=dict)
    """Micro-step index -> cell whose result was accepted."""
    num_redone: int = 0
    """Claims given back by cells that left, died or timed out before finishing."""
    claimed_at: dict[int, float] = field(default_factory=dict)
    """Micro-step index -> when (caller's clock, seconds) it was claimed."""

    def claim(self, cell: str, now: float = 0.0) -> int | None:
        """The lowest micro-step nobody holds or finished, now held by `cell`; None if none is left."""
        i = self.next_pending()
        if i is not None:
            self.claims[i] = cell
            self.claimed_at[i] = now
        return i

    def next_pending(self) -> int | None:
        """The micro-step `claim` would hand out next (None if none is left)."""
        return next((i for i in range(self.num_microsteps) if i not in self.claims and i not in self.done_by), None)

    def overdue(self, now: float, timeout_s: float) -> set[str]:
        """Cells holding a claim for longer than `timeout_s`."""
        return {self.claims[i] for i, t in self.claimed_at.items() if now - t > timeout_s}

    def complete(self, cell: str, index: int) -> bool:
        """Accept `cell`'s result for `index`; False (ignore the result) unless `cell` holds the claim."""
        if self.claims.get(index) != cell:
            return False
        del self.claims[index], self.claimed_at[index]
        self.done_by[index] = cell
        return True

    def release(self, cell: str) -> list[int]:
        """Give back every claim `cell` holds (it left or died); returns the indices."""
        lost = sorted(i for i, c in self.claims.items() if c == cell)
        for i in lost:
            del self.claims[i], self.claimed_at[i]
        self.num_redone += len(lost)
        return lost

    @property
    def has_pending(self) -> bool:
        return len(self.claims) + len(self.done_by) < self.num_microsteps

    @property
    def finished(self) -> bool:
        return len(self.done_by) == self.num_microsteps
