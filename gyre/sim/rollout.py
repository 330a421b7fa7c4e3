"""The simulator's rollout side: executions from admission to a ready group.

    admit batch (staleness) -> waiting -> least-loaded serving cell -> coordinator starts it
        -> model call (slot, KV) -> tool calls -> ... -> finished or time budget
        -> coordinator collects it -> group ready -> micro-step queue

The coordinator starts executions one at a time (`start_s` each, the profile's); while a burst of
starts holds it (at most `start_budget_s` a turn of its loop), it collects no ended execution
(gyre.coordinator.rollouts: start_queued, then collect, in one turn of the loop).

A session that loses its cell is handed off, parked while no cell serves, or rebalanced onto a
cell back in rollout. `RolloutSide` is half of `gyre.sim.engine.Simulation`: it uses the engine's
clock, event heap, cells and queue, and calls back into its training side and policy.
"""

import heapq
from collections import deque

from gyre.scheduler.policy import rebalance
from gyre.scheduler.streaming import may_admit, trained_spans
from gyre.sim.kv import GPU
from gyre.sim.parts import COLLECT, EXEC_END, SEG_END, START, WAKE, Session, SimGroup
from gyre.sim.workload import draw_batch, train_tokens


class RolloutSide:
    """Admission, placement and model calls of the live executions, and what they leave to train."""

    def _init_rollout(self):
        self.waiting: deque = deque()
        self.waiting_by_step: dict[int, int] = {}
        self.running_by_step: dict[int, int] = {}
        self.blocked: dict = {}  # insertion-ordered set
        self.running = 0
        self.coordinator_free = 0.0  # when the coordinator's last start of a burst is done
        self.next_batch = 0
        self.started = 0
        self.session_tok_s = self.preset.session_tok_s
        self.ctx_per_seg, self.max_ctx = self.profile.context_tokens_per_segment, self.profile.max_context_tokens
        self.longest_s: list[float] = []
        self.group_longest_s: list[list[float]] = []  # per step admitted, per group (unloaded, capped)
        self.group_work: dict[int, list[tuple[float, int]]] = {}  # per step trained: (group's unloaded, tokens)
        self.num_timeouts = 0
        self.num_excluded = 0
        self.num_blocked = 0
        self.num_stale_dropped = 0
        self.masked_segments = self.trained_segments = 0
        # Of the executions trained or excluded: tokens generated, new prompt tokens, KV
        # token-seconds of their model calls; all of them, and those of the batches admitted at 0.
        self.useful = [0.0, 0.0, 0.0]
        self.useful_first = [0.0, 0.0, 0.0]

    def _may_admit(self, step: int) -> bool:
        """The staleness rule, or (admission: staleness) one step further once the batch that
        must be trained first is ready (its early spans are masked as older than the bound)."""
        v, s = self.queue.version, self.cfg.staleness
        if may_admit(step, v, s):
            return True
        return self.cfg.admission == "staleness" and step == v + s + 1 and self.queue.batch_ready(v)

    def _admit_batches(self):
        first_ready = self.cfg.batching == "first_ready"  # a slice of a longer run: keep launching
        while (first_ready or self.next_batch < self.num_steps) and self._may_admit(self.next_batch):
            step = self.next_batch
            b = draw_batch(self.profile, step, self.seed, self.tail_scale, self.preset.session_tok_s)
            self.longest_s.append(b.longest_s)
            self.group_longest_s.append(b.group_longest_s)
            g_size = self.profile.group_size
            for g in range(self.profile.groups_per_step):
                group = SimGroup(g, step, self.queue.version, g_size)
                for e in range(g * g_size, (g + 1) * g_size):
                    self.waiting.append(Session(group, b.segments[e], b.offsets[e], b.excluded[e], b))
            self.waiting_by_step[step] = self.profile.executions_per_step
            self.next_batch += 1
        self._fill_slots()

    def _least_loaded(self, need_slot: bool):
        """The serving cell with the lowest load; with `need_slot`, only one with room for a new
        session: its GPUs' sessions plus an equal share of the pooled offload tier."""
        best = None
        extra = self.pooled_sessions // max(1, sum(sc.serving for sc in self.cells)) if need_slot else 0
        for sc in self.cells:
            if sc.serving and (not need_slot or len(sc.members) < sc.max_sessions + extra):
                if best is None or len(sc.members) * best.max_sessions < len(best.members) * sc.max_sessions:
                    best = sc
        return best

    def _fill_slots(self):
        while self.waiting:
            sc = self._least_loaded(need_slot=True)
            if sc is None:
                return
            s = self.waiting.popleft()
            self.waiting_by_step[s.group.step] -= 1
            self.running_by_step[s.group.step] = self.running_by_step.get(s.group.step, 0) + 1
            self.started += 1
            s.cell = sc
            sc.join(s, self.now)
            start = self._take_coordinator()
            s.deadline = start + self.profile.timeout_s
            self.running += 1
            if start > self.now:
                self._at(start, START, s)
            else:
                self._start_gen(s)

    def _take_coordinator(self) -> float:
        """When the coordinator starts the next execution: after the starts before it, each of
        which holds it `start_s` (the harness's time budget runs from its start)."""
        start = max(self.now, self.coordinator_free)
        self.coordinator_free = start + self.profile.start_s
        return start

    def _on_start(self, s, _token):
        self._start_gen(s)

    def loop_free_at(self) -> float:
        """When the coordinator's loop next collects and feeds training: after its burst of starts,
        or after the turn's start budget where one bounds it."""
        budget = self.profile.start_budget_s
        return min(self.coordinator_free, self.now + budget) if budget > 0 else self.coordinator_free

    def _start_gen(self, s):
        sc = s.cell
        if sc is None or not sc.serving:
            if sc is not None:
                sc.drop(s, self.now)
            sc = self._least_loaded(need_slot=False)
            s.cell = sc
            if sc is None:
                self.blocked[s] = self.now  # its time budget keeps running, as a harness's clock does
                self.num_blocked += 1
                return
            sc.join(s, self.now)
        if sc.eng.waiters or not self._call(sc, s):  # no slot: queue (FIFO) for the next call end
            sc.eng.waiters.append(s)
            self._wake(sc)

    def _call(self, sc, s) -> bool:
        """Start `s`'s model call on `sc` and schedule its segment's end; False when no slot is free."""
        i = s.off + s.seg
        ctx = s.seg * self.ctx_per_seg
        if ctx > self.max_ctx:
            ctx = self.max_ctx
        need = ctx + self.ctx_per_seg
        if need > self.max_ctx:
            need = self.max_ctx
        gen = s.gen[i]
        prompt = self.ctx_per_seg - gen if gen < self.ctx_per_seg else 0.0  # tool output to prefill
        end = sc.eng.start(s, self.now, ctx, need, gen, prompt)
        if end is None:
            return False
        sc.gen_tokens += gen
        s.gtok += gen
        s.ptok += prompt
        s.kvs += need * gen / self.session_tok_s  # the engine reserves the grown context from the start
        v = self.queue.version
        if s.ver != v:
            s.ver = v
            s.marks.append((v, s.seg))
        t = end + s.tool[i]  # the model call, then the segment's tool calls
        if t < s.deadline:
            heapq.heappush(self.heap, (t, next(self.seq), SEG_END, s, 0))
        else:
            heapq.heappush(self.heap, (max(s.deadline, self.now), next(self.seq), EXEC_END, s, 0))
        return True

    def _wake(self, sc):
        eng = sc.eng
        if eng.waiters and eng.wake_at is None and eng.busy:
            eng.wake_at = eng.busy[0][0]
            self._at(eng.wake_at, WAKE, sc)

    def _on_wake(self, sc, _token):
        eng = sc.eng
        if eng.wake_at != self.now:
            return  # superseded: the engine was vacated meanwhile
        eng.wake_at = None
        waiters = eng.waiters
        while waiters and self._call(sc, waiters[0]):  # first come, first served
            waiters.popleft()
        self._wake(sc)

    def _on_exec_end(self, s, _token):
        self.num_timeouts += 1
        self._finish(s)

    def _on_collect(self, s, _token):
        self._finish(s)

    def _finish(self, s):
        if self.now < self.coordinator_free:  # seen once the coordinator's loop is free of starts
            self._at(self.loop_free_at(), COLLECT, s)
            return
        if s.cell is not None:
            s.cell.drop(s, self.now)
        if s.eng is not None:
            s.eng.release(s)
        self.running -= 1
        g = s.group
        self.running_by_step[g.step] -= 1
        g.remaining -= 1
        g.execs.append((s.marks, s.seg, s.excluded, s.gtok, s.ptok, s.kvs))
        if g.remaining == 0:
            self._group_ready(g)
        self._fill_slots()

    def _group_ready(self, g):
        """Place a ready group in its step (see `batching`) and mask its spans older than the bound."""
        step = self.queue.open_step() if self.cfg.batching == "first_ready" else g.step
        tokens, oldest = 0, step
        for marks, done, excluded, gtok, ptok, kvs in g.execs:
            if excluded or done == 0:  # no valid reward, or its budget ran out before one segment
                self.num_excluded += 1
                self._count_useful(g, gtok, ptok, kvs)  # no mode avoids it: part of the ideal's work
                continue
            kept = trained_spans(marks, done, step, self.cfg.staleness)
            if kept is None:
                self.num_stale_dropped += 1
                continue
            first, v = kept
            self.masked_segments += first
            self.trained_segments += done - first
            self._count_useful(g, gtok, ptok, kvs)
            tokens += train_tokens(self.profile, done)  # masked spans are still computed as context
            oldest = min(oldest, v)
        unloaded = self.group_longest_s[g.step][g.gid] if self.cfg.batching == "fixed" else 0.0
        self.group_work.setdefault(step, []).append((unloaded, tokens))
        if tokens:
            self.queue.add_ready(step, g.gid, oldest, tokens, max_tokens=self.cfg.microstep_tokens)
        else:
            self.queue.exclude(step, g.gid)
        if step == self.queue.current_step:
            self._claim_all()
            if self.queue.batch_ready():
                self._admit_batches()
                self._consult()
            self._maybe_optimize()

    def _count_useful(self, g, gtok, ptok, kvs):
        for tally in (self.useful, self.useful_first) if g.step <= self.cfg.staleness else (self.useful,):
            tally[0] += gtok
            tally[1] += ptok
            tally[2] += kvs

    def _hand_off(self, sc):
        """Move a leaving cell's sessions to the serving cells (proxy reroute; KV via the host tier)."""
        waiters = sc.eng.vacate(sc.members)
        for s in list(sc.members):
            sc.drop(s, self.now)
            dest = self._least_loaded(need_slot=False)
            s.cell = dest
            if dest is not None:
                dest.join(s, self.now)
        for s in waiters:
            self._start_gen(s)

    def _unblock(self):
        """Parked sessions resume; a harness's clock never pauses, so one whose budget ran out
        while parked ends now as a timeout."""
        blocked, self.blocked = self.blocked, {}
        for s in blocked:
            if self.now >= s.deadline:
                self._on_exec_end(s, 0)
            else:
                self._start_gen(s)

    def _rebalance(self, sc):
        """Move live sessions between model calls onto `sc` (just back in rollout) from the most
        loaded serving cells: proxy reroute, their GPU KV through the offload tier."""
        moves = rebalance(self._observe().cells, sc.cell.index)
        for src_index, n in moves.items():
            src = self.cells[src_index]
            eng = src.eng
            eng.retire(self.now)
            in_call = {e[2] for e in eng.busy} | set(eng.waiters)
            movable = [s for s in src.members if s not in in_call][:n]
            for s in movable:
                if s.where == GPU and s in s.eng.idle:  # cached between calls: offload, reload there
                    s.eng.offload_idle(s)
                src.drop(s, self.now)
                s.cell = sc
                sc.join(s, self.now)
