"""Discrete-event simulation of a Gyre cluster driving the real scheduler objects on a virtual clock.

The simulator owns time and the workload; every decision comes from gyre.scheduler: the policy
(`make_policy`), the cell state machine (`Cell`), admission by staleness (`may_admit`) and the
micro-step queue (`MicroStepQueue`).

    admit batch (staleness) -> queue -> live on least-loaded ROLLOUT cell -> segments:
        model call on the cell's engine (gyre.sim.kv: slot, KV reload or prefill, decode)
        -> tool call (wall time, no slot) -> ... -> finished or time budget -> group ready
    TRAIN cells claim micro-steps -> step complete -> core optimizer step -> version + 1
    policy consulted every tick and after steps and switches -> Cell.begin_switch -> phases

The engine model (gyre.sim.kv) is the same in every mode: a cell leaving rollout (elastic's
hand-off, colocate's switch to training) offloads its sessions' KV to the host tier and the
cell that serves them next reloads it. A model call keeps the duration computed at its start
even if its session is handed off meanwhile. A session whose cell left with no serving cell to
take it (colocate while training) keeps running tool calls and waits at its next model call
with its time budget paused.

Live sessions are bounded by what the serving cells' GPUs and the cluster-wide (pooled) offload
tier hold at the profile's mean context (beyond that every call would recompute); executions
beyond them queue (the waterlevel counts them). The policy sees each cell's serving capacity at
the profile's mean context: sessions its GPUs hold, and the decode those calls sustain (at long
contexts the GPU KV, not the batch limit, caps the calls in flight).
"""

import heapq
import itertools
from collections import deque

from gyre.scheduler.cells import PHASE_SHARES, Phase, Role, make_cells
from gyre.scheduler.config import SchedulerConfig
from gyre.scheduler.observe import make_observation
from gyre.scheduler.policy import Decision, Observation, make_policy
from gyre.scheduler.streaming import MicroStepQueue, may_admit, trained_spans
from gyre.sim.config import PresetConfig, ProfileConfig
from gyre.sim.kv import NONE, CellEngine, HostTier
from gyre.sim.result import CellStats, ModeResult, critical_path_s
from gyre.sim.workload import draw_batch, mean_context_tokens, train_share, train_tokens

SEG_END, EXEC_END, PHASE_END, MICRO_END, OPT_END, TICK, LOSS, WAKE = range(8)


class _Session:
    """One execution; it has at most one pending event (segment end or time budget), none while blocked."""

    __slots__ = ("group", "n_seg", "off", "seg", "deadline", "cell", "excluded", "gen", "tool",
                 "eng", "where", "kv", "call", "ver", "marks", "gtok")

    def __init__(self, group, n_seg, off, excluded, batch):
        self.group, self.n_seg, self.off, self.excluded = group, n_seg, off, excluded
        self.seg, self.deadline, self.cell = 0, 0.0, None
        self.eng, self.where, self.kv, self.call = None, NONE, 0.0, 0
        self.gen, self.tool = batch.gen_tokens, batch.tool_s
        self.ver, self.marks, self.gtok = -1, [], 0.0  # marks: (version, first segment under it)


class _Group:
    __slots__ = ("gid", "step", "version", "remaining", "execs")

    def __init__(self, gid, step, version, size):
        self.gid, self.step, self.version, self.remaining, self.execs = gid, step, version, size, []


class _SimCell:
    """The simulator's bookkeeping beside one scheduler Cell."""

    def __init__(self, cell, preset: PresetConfig, ctx_tokens: float, host: HostTier):
        self.cell = cell
        self.serving = cell.role is Role.ROLLOUT
        self.members: dict = {}  # insertion-ordered set: hand-offs replay the same in every process
        self.gen_tokens = 0.0
        n = cell.num_nodes
        self.eng = CellEngine(preset.kv_tokens_per_node * n, preset.max_sessions_per_node * n,
                              preset.gen_tok_s_per_node * n, preset.session_tok_s,
                              preset.prefill_tok_s_per_node * n, preset.kv_load_tok_s_per_node * n, host)
        self.max_sessions = preset.sessions_per_node(ctx_tokens) * n
        self.gen_tok_s = preset.serving_tok_s_per_node(ctx_tokens) * n  # what the policy is told
        self.train_tok_s = preset.train_tok_s_per_node * cell.num_nodes
        self.slot_s = 0.0
        self.slot_t = 0.0
        self.micro = None
        self.micro_start = self.micro_end = 0.0
        self.token = 0
        self.target = None
        self.stats = CellStats(index=cell.index, is_core=cell.is_core)

    def join(self, s, now):
        self.slot_s += len(self.members) * (now - self.slot_t)
        self.slot_t = now
        self.members[s] = None

    def drop(self, s, now):
        self.slot_s += len(self.members) * (now - self.slot_t)
        self.slot_t = now
        self.members.pop(s, None)


class Simulation:
    """One mode on one workload and cluster; `run()` returns a ModeResult.

    Args:
        scheduler: the scheduler config; its `mode` selects the policy.
        tail_scale: multiplies the profile's duration tail (sensitivity).
    """

    def __init__(self, profile: ProfileConfig, preset: PresetConfig, scheduler: SchedulerConfig,
                 num_steps: int, seed: int = 0, tick_s: float = 10.0, tail_scale: float = 1.0,
                 losses: tuple[tuple[int, float], ...] = ()):
        self.profile, self.preset, self.cfg = profile, preset, scheduler
        self.losses = losses
        self.stall_s = 20 * profile.timeout_s + 86400.0
        self.num_steps, self.seed, self.tick_s, self.tail_scale = num_steps, seed, tick_s, tail_scale
        cells = make_cells(preset.num_cells, preset.cell_nodes)
        self.policy = make_policy(scheduler, preset.num_cells, train_share(profile, preset, seed))
        for cell, role in zip(cells, self.policy.initial_roles()):
            cell.role = role
        ctx = mean_context_tokens(profile, seed)
        self.pooled_sessions = preset.pooled_sessions(ctx)
        self.host = HostTier(preset.host_kv_tokens_per_node * preset.num_nodes)
        self.cells = [_SimCell(c, preset, ctx, self.host) for c in cells]
        self.core = self.cells[0]
        self.sat_train_tok_s = self.cells[-1].train_tok_s
        self.queue = MicroStepQueue(profile.groups_per_step, scheduler.staleness)
        self.heap: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.waiting: deque = deque()
        self.waiting_by_step: dict[int, int] = {}
        self.blocked: dict = {}  # insertion-ordered set
        self.running = 0
        self.next_batch = 0
        self.optimizing = False
        self.step_times: list[float] = []
        self.levels: list[tuple[float, int]] = []
        self.session_tok_s = preset.session_tok_s
        self.ctx_per_seg, self.max_ctx = profile.context_tokens_per_segment, profile.max_context_tokens
        self.train_tokens_total = 0
        self.longest_s: list[float] = []
        self.num_switches = 0
        self.num_timeouts = 0
        self.num_excluded = 0
        self.num_blocked = 0
        self.num_stale_dropped = 0
        self.masked_segments = self.trained_segments = 0
        self.useful_gen = 0.0  # tokens generated by executions that were trained or excluded

    # ---- event plumbing -------------------------------------------------------------------
    def _at(self, t, kind, obj, token=0):
        heapq.heappush(self.heap, (t, next(self.seq), kind, obj, token))

    def run(self) -> ModeResult:
        """Simulate until `num_steps` optimizer steps are applied."""
        for sc in self.cells:
            sc.stats.timeline.append((0.0, sc.cell.role.value))
        self._admit_batches()
        self._at(0.0, TICK, None)
        for index, at_s in self.losses:
            self._at(at_s, LOSS, self.cells[index])
        handlers = (None, self._on_exec_end, self._on_phase_end,
                    self._on_micro_end, self._on_opt_end, self._on_tick, self._on_loss, self._on_wake)
        heap, pop, queue, num_steps, start_gen = self.heap, heapq.heappop, self.queue, self.num_steps, self._start_gen
        while heap and queue.version < num_steps:
            t, _, kind, obj, token = pop(heap)
            self.now = t
            if kind == SEG_END:  # the hot path, inlined: next segment or done
                obj.seg += 1
                if obj.seg < obj.n_seg:
                    start_gen(obj)
                    continue
                self._finish(obj)
            else:
                handlers[kind](obj, token)
        return self._result()

    # ---- rollout side ---------------------------------------------------------------------
    def _admit_batches(self):
        first_ready = self.cfg.batching == "first_ready"  # a slice of a longer run: keep launching
        while (first_ready or self.next_batch < self.num_steps) and may_admit(self.next_batch, self.queue.version, self.cfg.staleness):
            step = self.next_batch
            b = draw_batch(self.profile, step, self.seed, self.tail_scale, self.preset.session_tok_s)
            self.longest_s.append(b.longest_s)
            g_size = self.profile.group_size
            for g in range(self.profile.groups_per_step):
                group = _Group(g, step, self.queue.version, g_size)
                for e in range(g * g_size, (g + 1) * g_size):
                    self.waiting.append(_Session(group, b.segments[e], b.offsets[e], b.excluded[e], b))
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
            s.cell = sc
            sc.join(s, self.now)
            s.deadline = self.now + self.profile.timeout_s
            self.running += 1
            self._start_gen(s)

    def _start_gen(self, s):
        sc = s.cell
        if sc is None or not sc.serving:
            if sc is not None:
                sc.drop(s, self.now)
            sc = self._least_loaded(need_slot=False)
            s.cell = sc
            if sc is None:
                self.blocked[s] = self.now  # its time budget pauses while no cell serves it
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
        end = sc.eng.start(s, self.now, ctx, need, s.gen[i])
        if end is None:
            return False
        sc.gen_tokens += s.gen[i]
        s.gtok += s.gen[i]
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

    def _finish(self, s):
        if s.cell is not None:
            s.cell.drop(s, self.now)
        if s.eng is not None:
            s.eng.release(s)
        self.running -= 1
        g = s.group
        g.remaining -= 1
        g.execs.append((s.marks, s.seg, s.excluded, s.gtok))
        if g.remaining == 0:
            self._group_ready(g)
        self._fill_slots()

    def _group_ready(self, g):
        """Place a ready group in its step (see `batching`) and mask its spans older than the bound."""
        step = self.queue.open_step() if self.cfg.batching == "first_ready" else g.step
        tokens, oldest = 0, step
        for marks, done, excluded, gtok in g.execs:
            if excluded:
                self.num_excluded += 1
                self.useful_gen += gtok  # no mode avoids it: part of the ideal's work
                continue
            kept = trained_spans(marks, done, step, self.cfg.staleness)
            if kept is None:
                self.num_stale_dropped += 1
                continue
            first, v = kept
            self.masked_segments += first
            self.trained_segments += done - first
            self.useful_gen += gtok
            tokens += train_tokens(self.profile, done)  # masked spans are still computed as context
            oldest = min(oldest, v)
        if tokens:
            self.queue.add_ready(step, g.gid, oldest, tokens)
        else:
            self.queue.exclude(step, g.gid)
        if step == self.queue.current_step:
            self._claim_all()
            if self.queue.batch_ready():
                self._consult()

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
        blocked, self.blocked = self.blocked, {}
        for s, since in blocked.items():
            s.deadline += self.now - since
            self._start_gen(s)

    # ---- training side --------------------------------------------------------------------
    def _claim_all(self):
        for sc in self.cells:
            self._claim(sc)

    def _claim(self, sc):
        if sc.cell.role is not Role.TRAIN or sc.micro is not None or self.optimizing:
            return
        ms = self.queue.claim()
        if ms is None:
            return
        sc.cell.join_step(ms.step)
        if self.core.cell.role is Role.TRAIN:
            self.core.cell.join_step(ms.step)  # the core is part of every step it can train
        sc.micro, sc.micro_start = ms, self.now
        sc.micro_end = self.now + ms.tokens / sc.train_tok_s
        self._at(sc.micro_end, MICRO_END, sc, sc.token)

    def _on_micro_end(self, sc, token):
        if token != sc.token:
            return
        self.queue.complete(sc.micro)
        self.train_tokens_total += sc.micro.tokens
        sc.stats.train_busy_s += self.now - sc.micro_start
        sc.micro = None
        if not sc.cell.is_core:
            sc.cell.leave_step()
        self._claim(sc)
        if self.queue.step_complete() and not self.optimizing:
            self.optimizing = True
            self._at(self.now + self.preset.optimizer_step_s, OPT_END, None)

    def _on_opt_end(self, _obj, _token):
        self.optimizing = False
        self.queue.apply_optimizer_step()
        for sc in self.cells:
            if sc.micro is None:
                sc.cell.leave_step()
        self.step_times.append(self.now)
        self._admit_batches()
        self._consult()  # before claiming: colocate sends its cells back before they touch the next step
        self._claim_all()

    # ---- roles ----------------------------------------------------------------------------
    def _on_tick(self, _obj, _token):
        last = self.step_times[-1] if self.step_times else 0.0
        if self.now - last > self.stall_s:
            raise RuntimeError(f"simulation stalled: no optimizer step for {self.now - last:.0f} s at version "
                               f"{self.queue.version} (no cell left to serve or train?)")
        self.levels.append((self.now, len(self.waiting) + self.running))
        self._consult()
        self._at(self.now + self.tick_s, TICK, None)

    def _observe(self) -> Observation:
        cells = self.cells
        return make_observation(
            self.now, [sc.cell for sc in cells], [len(sc.members) for sc in cells], [sc.max_sessions for sc in cells],
            [sc.gen_tok_s for sc in cells], queued=len(self.waiting), running=self.running,
            queued_ahead=sum(n for step, n in self.waiting_by_step.items() if step > self.queue.current_step),
            queue=self.queue, train_tok_s=self.sat_train_tok_s, optimizing=self.optimizing,
            gen_demand_tok_s=sum(sc.eng.generating(self.now) for sc in cells) * self.preset.session_tok_s,
            pooled_sessions=self.pooled_sessions,
        )

    def _consult(self):
        d: Decision = self.policy.decide(self._observe())
        for i in d.to_train:
            self._begin(self.cells[i], Role.TRAIN)
        for i in d.to_rollout:
            self._begin(self.cells[i], Role.ROLLOUT)

    def _begin(self, sc, target):
        self.num_switches += 1
        sc.target = target
        sc.stats.switches += 1
        sc.cell.begin_switch(target, self.now)
        sc.stats.timeline.append((self.now, sc.cell.role.value))
        sc.serving = False
        if target is Role.TRAIN:
            self._hand_off(sc)
        self._schedule_phase(sc)

    def _schedule_phase(self, sc):
        phase = sc.cell.phase
        if phase is Phase.FINISH_MICROSTEP:
            dur = self._finish_or_hand_back(sc)
        else:
            cost = self.cfg.rollout_to_train_s if sc.target is Role.TRAIN else self.cfg.train_to_rollout_s
            dur = cost * PHASE_SHARES[phase]
        sc.stats.switch_s += dur
        self._at(self.now + dur, PHASE_END, sc, sc.token)

    def _finish_or_hand_back(self, sc) -> float:
        if sc.micro is None:
            return 0.0
        left = sc.micro_end - self.now
        if left <= self.cfg.finish_microstep_max_s:
            return left  # its MICRO_END fires first (earlier sequence number)
        self.queue.hand_back(sc.micro)
        sc.micro = None
        sc.token += 1
        sc.cell.leave_step()
        self._claim_all()
        return 0.0

    def _on_loss(self, sc, _token):
        """A satellite stops answering: its sessions lose their KV, its micro-step goes back."""
        was_serving = sc.serving
        sc.serving = False
        sc.cell.lose(self.now)
        sc.stats.timeline.append((self.now, Role.LOST.value))
        if sc.micro is not None:
            self.queue.hand_back(sc.micro)
            sc.micro = None
        sc.token += 1  # its pending micro-step or phase end no longer happens
        waiters = sc.eng.vacate(sc.members, lost=True)
        for s in list(sc.members):
            sc.drop(s, self.now)
            s.cell = None  # re-placed, with a prefill, at its next model call
        for s in waiters:
            self._start_gen(s)
        if was_serving:
            self._fill_slots()
        self._claim_all()
        self._consult()

    def _on_phase_end(self, sc, token):
        if token != sc.token:
            return
        if sc.cell.next_phase(self.now) is not None:
            self._schedule_phase(sc)
            return
        sc.stats.timeline.append((self.now, sc.cell.role.value))
        sc.serving = sc.cell.role is Role.ROLLOUT
        if sc.cell.role is Role.TRAIN:
            self._claim(sc)
        else:
            self._fill_slots()
            self._unblock()

    # ---- result ---------------------------------------------------------------------------
    def _result(self) -> ModeResult:
        total = self.now
        for sc in self.cells:
            st = sc.stats
            st.gen_tokens = sc.gen_tokens
            sc.drop(None, total)
            # A rollout cell is busy as far as its binding resource is used: decode throughput
            # or session slots (KV); a training cell while it computes micro-steps.
            slots = sc.max_sessions + self.pooled_sessions * sc.cell.num_nodes / self.preset.num_nodes
            useful = st.train_busy_s + max(st.gen_tokens / sc.gen_tok_s, sc.slot_s / slots)
            st.idle_fraction = min(1.0, max(0.0, 1.0 - useful / total))
        prefill = sum(sc.eng.prefill_tokens for sc in self.cells)
        gen = sum(sc.gen_tokens for sc in self.cells)
        # The ideal counts only work the N steps needed: executions trained or excluded, not those
        # dropped as stale or still running for later steps (prefill shared out pro rata).
        useful = self.useful_gen / gen if gen else 1.0
        rollout_node_s = useful * (gen / self.preset.decode_tok_s_per_node + prefill / self.preset.prefill_tok_s_per_node)
        work_node_s = rollout_node_s + self.train_tokens_total / self.preset.train_tok_s_per_node
        # A step waits for its longest execution only with fixed batching; otherwise only the
        # sequential optimizer steps bound the latency.
        longest = self.longest_s[:self.num_steps] if self.cfg.batching == "fixed" else [0.0] * self.num_steps
        return ModeResult(
            mode=self.cfg.mode, total_s=total, step_times_s=self.step_times,
            cells=[sc.stats for sc in self.cells], work_node_s=work_node_s,
            num_nodes=self.preset.num_nodes, levels=self.levels, num_switches=self.num_switches,
            num_timeouts=self.num_timeouts, num_excluded=self.num_excluded,
            async_train_cells=getattr(self.policy, "num_train", None),
            num_blocked=self.num_blocked, max_staleness=self.queue.max_lag, prefill_tokens=prefill,
            reload_tokens=sum(sc.eng.load_tokens for sc in self.cells),
            critical_path_s=critical_path_s(longest, self.cfg.staleness, self.preset.optimizer_step_s),
            num_stale_dropped=self.num_stale_dropped,
            masked_fraction=self.masked_segments / max(1, self.masked_segments + self.trained_segments),
        )
