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
while its time budget keeps running (a harness's wall clock never pauses).

Live sessions are bounded by what the serving cells' GPUs and the cluster-wide (pooled) offload
tier hold at the profile's mean context (beyond that every call would recompute); executions
beyond them queue (the waterlevel counts them). The policy sees each cell's serving capacity at
the profile's mean context: sessions its GPUs hold, and the decode those calls sustain (at long
contexts the GPU KV, not the batch limit, caps the calls in flight).

The coordinator is one loop: with the profile's `start_s` it starts executions one at a time,
and a burst of starts (at most the profile's `start_budget_s` a turn) delays what the same turn of
its loop does after it (seeing executions end, handing training the step an optimizer step
opened), as `gyre.coordinator.loop._tick` does.

This module owns the clock, the event loop, the training side, the cells' roles and the result;
the rollout side (admission to ready group) is `gyre.sim.rollout.RolloutSide`.
"""

import heapq
import itertools

from gyre.scheduler.cells import PHASE_SHARES, Phase, Role, make_cells
from gyre.scheduler.config import SchedulerConfig
from gyre.scheduler.observe import make_observation
from gyre.scheduler.policy import Decision, Observation, make_policy
from gyre.scheduler.streaming import MicroStepQueue
from gyre.sim.config import PresetConfig, ProfileConfig
from gyre.sim.cost import derive_costs
from gyre.sim.kv import HostTier
from gyre.sim.parts import FEED, LOSS, MICRO_END, OPT_END, PHASE_END, SEG_END, TICK, SimCell
from gyre.sim.result import ModeResult, critical_path_s, startup_bound_s
from gyre.sim.rollout import RolloutSide
from gyre.sim.workload import budget_hit_fraction, mean_context_tokens, train_share


class Simulation(RolloutSide):
    """One mode on one workload and cluster; `run()` returns a ModeResult.

    Args:
        scheduler: the scheduler config; its `mode` selects the policy.
        tail_scale: multiplies the profile's duration tail (sensitivity).
    """

    def __init__(
        self,
        profile: ProfileConfig,
        preset: PresetConfig,
        scheduler: SchedulerConfig,
        num_steps: int,
        seed: int = 0,
        tick_s: float = 10.0,
        tail_scale: float = 1.0,
        losses: tuple[tuple[int, float], ...] = (),
        phase_s: dict[str, float] | None = None,
    ):
        self.profile, self.preset, self.cfg = profile, preset, scheduler
        self.phase_s = phase_s or {}  # measured seconds per switch phase, by Phase value
        self.losses = losses
        self.stall_s = 20 * profile.timeout_s + 86400.0
        self.num_steps, self.seed, self.tick_s, self.tail_scale = num_steps, seed, tick_s, tail_scale
        self._build_cells()
        self.queue = MicroStepQueue(profile.groups_per_step, scheduler.staleness)
        self.heap: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.optimizing = False
        self.feed_at = 0.0  # the current step reaches training once the coordinator is free
        self.step_times: list[float] = []
        self.levels: list[tuple[float, int]] = []
        self.train_tokens_total = 0
        self.num_switches = 0
        self._init_rollout()

    def _build_cells(self):
        """Costs, the policy and its initial roles, and the cells' engines over one host tier."""
        profile, preset, seed = self.profile, self.preset, self.seed
        cells = make_cells(preset.num_cells, preset.cell_nodes)
        self.costs = costs = derive_costs(profile, preset, seed)
        share = train_share(profile, preset, seed, costs.train_tok_s_per_node, costs.prefill_tok_s_per_node)
        self.policy = make_policy(self.cfg, preset.num_cells, share)
        for cell, role in zip(cells, self.policy.initial_roles()):
            cell.role = role
        ctx = mean_context_tokens(profile, seed)
        host_nodes = preset.num_nodes
        if preset.host_tier_scope == "rollout_pool":  # only nodes that start in rollout hold KV
            host_nodes = sum(c.num_nodes for c in cells if c.role is Role.ROLLOUT)
        self.pooled_sessions = preset.pooled_sessions(ctx, host_nodes)
        host = HostTier(preset.host_kv_tokens_per_node * host_nodes)
        self.cells = [SimCell(c, preset, costs, ctx, host) for c in cells]
        self.core = self.cells[0]
        self.sat_train_tok_s = self.cells[-1].train_tok_s

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
        handlers = (
            None,
            self._on_exec_end,
            self._on_phase_end,
            self._on_micro_end,
            self._on_opt_end,
            self._on_tick,
            self._on_loss,
            self._on_wake,
            self._on_start,
            self._on_collect,
            self._on_feed,
        )
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

    # ---- training side --------------------------------------------------------------------
    def _claim_all(self):
        for sc in self.cells:
            self._claim(sc)

    def _claim(self, sc):
        if sc.cell.role is not Role.TRAIN or sc.micro is not None or self.optimizing or self.now < self.feed_at:
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
        self._maybe_optimize()

    def _maybe_optimize(self):
        """Start the core's optimizer step once the current step is complete: its last micro-step
        ended, or its last group was excluded (a step whose every group is excluded has none)."""
        if self.queue.step_complete() and not self.optimizing:
            self.optimizing = True
            self._at(self.now + self.costs.optimizer_step_s, OPT_END, None)

    def _on_opt_end(self, _obj, _token):
        self.optimizing = False
        self.queue.apply_optimizer_step()
        for sc in self.cells:
            if sc.micro is None:
                sc.cell.leave_step()
        self.step_times.append(self.now)
        self._admit_batches()
        # the live coordinator hands training the new step in the same turn of its loop, after
        # starting the executions admitted: a burst of starts delays it
        self.feed_at = self.loop_free_at()
        if self.feed_at > self.now:
            self._at(self.feed_at, FEED, None)
        self._consult()  # before claiming: colocate sends its cells back before they touch the next step
        self._claim_all()
        self._maybe_optimize()

    def _on_feed(self, _obj, _token):
        self._claim_all()

    # ---- roles ----------------------------------------------------------------------------
    def _on_tick(self, _obj, _token):
        last = self.step_times[-1] if self.step_times else 0.0
        if self.now - last > self.stall_s:
            raise RuntimeError(
                f"simulation stalled: no optimizer step for {self.now - last:.0f} s at version "
                f"{self.queue.version} (no cell left to serve or train?)"
            )
        self.levels.append((self.now, len(self.waiting) + self.running))
        self._consult()
        self._at(self.now + self.tick_s, TICK, None)

    def _observe(self) -> Observation:
        cells, current = self.cells, self.queue.current_step
        demand = sum(sc.eng.generating(self.now) for sc in cells) * self.preset.session_tok_s
        return make_observation(
            self.now,
            [sc.cell for sc in cells],
            [len(sc.members) for sc in cells],
            [sc.max_sessions for sc in cells],
            [sc.gen_tok_s for sc in cells],
            queued=len(self.waiting),
            running=self.running,
            queued_ahead=sum(n for step, n in self.waiting_by_step.items() if step > current),
            running_ahead=sum(n for step, n in self.running_by_step.items() if step > current),
            work=self.queue,
            train_tok_s=self.sat_train_tok_s,
            optimizing=self.optimizing,
            gen_demand_tok_s=demand,
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
            dur = self.phase_s.get(phase.value, cost * PHASE_SHARES[phase])
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
            if self.cfg.rebalance_on_return:
                self._rebalance(sc)
            self._fill_slots()
            self._unblock()

    # ---- result ---------------------------------------------------------------------------
    def _result(self) -> ModeResult:
        total = self.now
        self._close_cell_stats(total)
        rollout_s, train_s, startup_s = self._work_bounds_s()
        return ModeResult(
            mode=self.cfg.mode,
            total_s=total,
            step_times_s=self.step_times,
            cells=[sc.stats for sc in self.cells],
            work_node_s=(rollout_s + train_s) * self.preset.num_nodes,
            num_nodes=self.preset.num_nodes,
            levels=self.levels,
            num_switches=self.num_switches,
            num_timeouts=self.num_timeouts,
            num_excluded=self.num_excluded,
            async_train_cells=getattr(self.policy, "num_train", None),
            num_blocked=self.num_blocked,
            max_staleness=self.queue.max_lag,
            prefill_tokens=sum(sc.eng.prefill_tokens for sc in self.cells),
            reload_tokens=sum(sc.eng.load_tokens for sc in self.cells),
            critical_path_s=self._critical_path_s(),
            rollout_work_s=rollout_s,
            train_work_s=train_s,
            recompute_tokens=sum(sc.eng.recompute_tokens for sc in self.cells),
            budget_hit_fraction=self.num_timeouts / max(1, self.started),
            rollout_latency_s=sum(self.longest_s[: self.num_steps]) / self.num_steps,
            budget_hit_unloaded=budget_hit_fraction(self.profile, self.preset.session_tok_s, self.seed),
            train_tok_s_per_node=self.costs.train_tok_s_per_node,
            prefill_tok_s_per_node=self.costs.prefill_tok_s_per_node,
            num_stale_dropped=self.num_stale_dropped,
            trained_tokens=self.train_tokens_total,
            startup_bound_s=startup_s,
            masked_fraction=self.masked_segments / max(1, self.masked_segments + self.trained_segments),
        )

    def _close_cell_stats(self, total: float):
        """Each cell's generated tokens, busy time and idle fraction over the run's `total` seconds."""
        for sc in self.cells:
            st = sc.stats
            st.gen_tokens = sc.gen_tokens
            sc.drop(None, total)
            # A rollout cell is busy as far as its binding resource is used: decode throughput
            # or session slots (KV); a training cell while it computes micro-steps.
            slots = sc.max_sessions + self.pooled_sessions * sc.cell.num_nodes / self.preset.num_nodes
            useful = st.train_busy_s + max(st.gen_tokens / sc.gen_tok_s, sc.slot_s / slots)
            st.rollout_use_s = st.gen_tokens / sc.eng.gen_tok_s + sc.eng.prefill_tokens / sc.eng.prefill_tok_s
            st.idle_fraction = min(1.0, max(0.0, 1.0 - useful / total))

    def _work_bounds_s(self) -> tuple[float, float, float]:
        """The ideal's rollout and training seconds on the whole cluster, and its startup bound.

        The ideal counts only work the N steps needed: executions trained or excluded, not those
        dropped as stale or still running for later steps; recomputed context is a mode's own
        waste and not counted. Decode and prefill share a cell's GPUs (gyre.sim.kv reserves
        both against its decode throughput), so their times add; a call also holds its grown
        context (context, new prompt and output: gyre.sim.kv reserves it at the call's start) in
        GPU KV for at least its unloaded decode time, so serving takes at least the calls' KV
        token-seconds / the cluster's GPU KV; training is compute on cells that are
        not serving. Every node-second either serves or trains (or switches), so the sum bounds.
        """
        gen_cap = sum(sc.eng.gen_tok_s for sc in self.cells)
        prefill_cap = sum(sc.eng.prefill_tok_s for sc in self.cells)
        kv_cap = sum(sc.eng.kv_cap for sc in self.cells)
        train_cap = sum(sc.train_tok_s for sc in self.cells)
        (gen, prompt, kvs), (gen0, prompt0, kvs0) = self.useful, self.useful_first
        rollout_s = max(gen / gen_cap + prompt / prefill_cap, kvs / kv_cap)
        train_s = self.train_tokens_total / train_cap
        first_release = min(min(g, default=0.0) for g in self.group_longest_s[: self.cfg.staleness + 1])
        startup_s = startup_bound_s(
            first_release,
            train_s,
            (gen / gen_cap + prompt / prefill_cap, kvs / kv_cap),
            (gen0 / gen_cap + prompt0 / prefill_cap, kvs0 / kv_cap),
        )
        return rollout_s, train_s, startup_s

    def _critical_path_s(self) -> float:
        """The steps' critical path with each group's training on the whole cluster.

        A group waits for its own step's executions only with fixed batching (see _group_ready).
        With first_ready batching a step's batch may fill with earlier steps' groups before it is
        admitted, so early admission has no known gate: only time 0 bounds it.
        """
        train_cap = sum(sc.train_tok_s for sc in self.cells)
        early = self.cfg.admission == "staleness"
        gate = self.num_steps if early and self.cfg.batching != "fixed" else self.cfg.staleness
        groups = [[(u, tok / train_cap) for u, tok in self.group_work.get(k, [])] for k in range(self.num_steps)]
        return critical_path_s(groups, gate, self.costs.optimizer_step_s, early_admission=early)
