"""Slurm's warning signal (preemption, the time limit), seen by the coordinator and by nothing it starts.

Slurm signals every process of a job step (`scancel -s USR2`, and submitit's `--signal=USR2@90`
before the time limit); by default the signal kills a process, so the proxy, engines and harness
sandboxes would die before the coordinator could checkpoint. `install` therefore ignores it, which
children inherit across exec (even through /bin/sh, which may not catch a signal ignored on entry),
and blocks it in every thread: on Linux a blocked signal is never discarded as ignored, it stays
pending until the one waiting thread takes it with `sigwait` and sets `event`.
"""

import signal
import threading
import time


class PreemptionSignal:
    """`event` is set, and `received_t` stamped, when `signum` reaches this process."""

    def __init__(self, signum: int = signal.SIGUSR2):
        self.signum = signum
        self.event = threading.Event()
        self.received_t: float | None = None

    def install(self) -> "PreemptionSignal":
        """Call from the main thread before any other thread or child starts (they inherit the mask)."""
        signal.signal(self.signum, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, {self.signum})
        threading.Thread(target=self._wait, name="preemption-signal", daemon=True).start()
        return self

    def _wait(self) -> None:
        signal.sigwait({self.signum})
        self.received_t = time.time()
        self.event.set()
