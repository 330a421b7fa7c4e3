"""A rollout engine's compute slots and KV cache, modelled on SGLang with HiCache; the same in every mode.

A session (one execution) holds a compute slot only during a model call. Between calls (tool
calls) its KV may stay cached on the GPU (radix cache, LRU), be offloaded to the host tier
(HiCache L2 host memory / L3 Mooncake store, pooled across the cluster) and reloaded at a
bandwidth cost, or be evicted and recomputed by prefill when memory is needed:

    model call: wait for a slot (batch limit, and GPU KV for the busy sessions' contexts)
        -> evict idle sessions LRU-first (to the host tier while it has room, else drop)
        -> KV on this GPU: start now | in the host tier: reload (load server) | dropped: prefill
        -> prefill the call's new prompt tokens (tool output), then decode at min(session speed,
           cell throughput / busy sessions)
    cell leaves rollout (any mode, colocate's parking included) or is lost: every session's GPU KV
        goes to the host tier while it has room (lost: dropped); whoever serves it next reloads it.

Reloads and prefills queue on one load server and one prefill server per cell (FIFO), so a cell
that recomputes a lot serves calls later. Prefill and decode share the GPUs: each call reserves,
for its whole duration, the decode-equivalent rate of its decode plus its prefill (prefill tokens x
decode/prefill throughput), and the reservations of a cell never exceed its decode throughput (a
call that would exceed it is slowed to fit, or waits when nothing is left). So a cell never does
more than its throughput allows, and work / capacity is a true lower bound of every run.
Pure bookkeeping on times handed in by the simulator.
"""

import heapq
import itertools
from collections import deque

GPU, HOST, NONE = 0, 1, 2
"""Where a session's KV lives: on its engine's GPU, in the host tier, or nowhere (recompute)."""


class HostTier:
    """The cluster's pooled offload tier (host memory + Mooncake L3), tokens."""

    __slots__ = ("cap", "used")

    def __init__(self, cap_tokens: float):
        self.cap, self.used = cap_tokens, 0.0

    def put(self, s) -> None:
        """Offload `s`'s KV here if it fits, else drop it."""
        if self.used + s.kv <= self.cap:
            self.used += s.kv
            s.where = HOST
        else:
            s.where, s.kv = NONE, 0.0


class CellEngine:
    """One cell's engines: busy calls, idle cached KV (LRU), waiters, and the load/prefill servers."""

    def __init__(self, kv_cap, batch_cap, gen_tok_s, session_tok_s, prefill_tok_s, load_tok_s, host: HostTier):
        self.kv_cap, self.batch_cap, self.host = kv_cap, batch_cap, host
        self.gen_tok_s, self.session_tok_s = gen_tok_s, session_tok_s
        self.prefill_tok_s, self.load_tok_s = prefill_tok_s, load_tok_s
        self.busy: list = []  # heap of (call end, seq, session, call id, reserved decode-equivalent tok/s)
        self.reserved = 0.0  # decode-equivalent tokens/s the busy calls hold
        self.idle: dict = {}  # sessions whose KV is cached here between calls, LRU first
        self.kv_used = 0.0  # GPU KV held: busy and idle sessions
        self.idle_kv = 0.0
        self.waiters: deque = deque()  # sessions waiting for a slot, first come first served
        self.wake_at = None  # time of the scheduled wake-up while waiters exist
        self.prefill_free = self.load_free = 0.0
        self.prefill_tokens = self.load_tokens = 0.0
        self.recompute_tokens = 0.0  # of prefill_tokens: context recomputed because its KV was dropped
        self.seq = itertools.count()

    def retire(self, now: float) -> None:
        """Calls that ended by `now` free their slots; their sessions' KV stays cached (idle)."""
        busy, idle = self.busy, self.idle
        while busy and busy[0][0] <= now:
            _, _, s, call, rate = heapq.heappop(busy)
            self.reserved -= rate
            if s.eng is self and s.call == call and s.where == GPU:
                idle[s] = None
                self.idle_kv += s.kv
        if not busy:
            self.reserved = 0.0  # no rounding drift survives an idle engine

    def generating(self, now: float) -> int:
        """Sessions in a model call here now, waiting ones included."""
        self.retire(now)
        return len(self.busy) + len(self.waiters)

    def start(self, s, now: float, ctx: float, need: float, tokens: float, prompt: float = 0.0) -> float | None:
        """Start `s`'s model call of `tokens` at `now` with context `ctx` growing to `need`, after
        prefilling `prompt` new tokens.

        Returns its end time, or None when no slot (or no decode capacity) is free: the caller
        queues it in `waiters`.
        """
        busy = self.busy
        if busy and busy[0][0] <= now:
            self.retire(now)
        free_rate = self.gen_tok_s - self.reserved
        if busy and (
            len(busy) >= self.batch_cap
            or self.kv_used - self.idle_kv + need > self.kv_cap
            or free_rate < 1e-6 * self.gen_tok_s
        ):
            return None
        on_gpu = s.where == GPU and s.eng is self
        held = 0.0
        if on_gpu:
            held = s.kv
            if s in self.idle:
                del self.idle[s]
                self.idle_kv -= held
        kv_used = self.kv_used = self.kv_used + need - held
        if kv_used > self.kv_cap:
            self._evict(kv_used - self.kv_cap)
        t0 = now
        if not on_gpu:
            if s.where == HOST:
                self.host.used -= s.kv
                self.load_free = max(now, self.load_free) + ctx / self.load_tok_s
                self.load_tokens += ctx
                t0 = self.load_free
            else:
                prompt += ctx  # dropped: the whole context is recomputed
                self.recompute_tokens += ctx
        if prompt > 0:
            self.prefill_free = max(t0, self.prefill_free) + prompt / self.prefill_tok_s
            self.prefill_tokens += prompt
            t0 = self.prefill_free
        s.eng, s.where, s.kv = self, GPU, need
        s.call += 1
        rate = self.gen_tok_s / (len(busy) + 1)
        if rate > self.session_tok_s:
            rate = self.session_tok_s
        end = t0 + tokens / rate
        work = tokens + prompt * self.gen_tok_s / self.prefill_tok_s  # decode-equivalent tokens
        hold = work / (end - now) if end > now else free_rate
        if hold > free_rate:  # the GPUs are shared: slow the call until its work fits
            end = now + work / free_rate
            hold = free_rate
        self.reserved += hold
        heapq.heappush(busy, (end, next(self.seq), s, s.call, hold))
        return end

    def _evict(self, excess: float) -> None:
        """Evict idle sessions LRU-first until `excess` tokens are freed (offload or drop)."""
        idle = self.idle
        while excess > 0 and idle:
            s = next(iter(idle))
            excess -= s.kv
            self.offload_idle(s)

    def offload_idle(self, s) -> None:
        """`s`, cached here between calls, leaves the GPU: its KV goes to the host tier (dropped when full)."""
        del self.idle[s]
        self.idle_kv -= s.kv
        self.kv_used -= s.kv
        self.host.put(s)

    def release(self, s) -> None:
        """`s` finished: its KV is freed wherever it lives."""
        if s.where == GPU and s.eng is self:
            self.kv_used -= s.kv
            if s in self.idle:
                del self.idle[s]
                self.idle_kv -= s.kv
        elif s.where == HOST:
            self.host.used -= s.kv
        s.where, s.kv = NONE, 0.0

    def vacate(self, sessions, lost: bool = False) -> list:
        """The engine releases its memory (leaves rollout, or is lost): its sessions' GPU KV goes
        to the host tier (dropped when lost or when the tier is full). Returns the waiters."""
        for s in sessions:
            if s.eng is self and s.where == GPU:
                if lost:
                    s.where, s.kv = NONE, 0.0
                else:
                    self.host.put(s)
        waiters = self.waiters
        self.busy, self.idle, self.waiters, self.wake_at = [], {}, deque(), None
        self.kv_used = self.idle_kv = self.reserved = 0.0
        return waiters
