"""Test helper for gyre/metrics: the events of a plausible short elastic run (a recorded fixture
while the coordinator is not merged).

Three cells: cell 0 is the core (always training), cells 1 and 2 serve rollouts; each step cell 2
switches to TRAIN (phases at the scheduler's PHASE_SHARES of 8.52 s) once most of the step's
executions have finished, computes micro-steps beside the core, and switches back (3.46 s) after
the optimizer step. One execution per step after the first times out (excluded), and an engine
fails once. Deterministic for a seed.
"""

from random import Random

from gyre.metrics.events import (
    Checkpoint,
    Event,
    Exclusion,
    ExecutionState,
    FailureEvent,
    HeldOutResult,
    MicroStepEvent,
    ModelCall,
    ObservationEvent,
    OptimizerStep,
    RoleSwitchEvent,
    RunStart,
    WeightPublish,
)
from gyre.scheduler.cells import PHASE_SHARES, PHASES, Role

T0 = 1_765_000_000.0
TO_TRAIN_S, TO_ROLLOUT_S = 8.52, 3.46


def _phases(role: Role, total_s: float) -> dict[str, float]:
    return {p.value: round(PHASE_SHARES[p] * total_s, 3) for p in PHASES[role]}


def make_run_events(
    num_steps: int = 4,
    groups_per_step: int = 2,
    group_size: int = 3,
    seed: int = 0,
    t0: float = T0,
    mode: str = "elastic",
) -> list[Event]:
    """Every event of the run, in time order (as the one events file would hold them)."""
    rng = Random(seed)
    events: list[Event] = [RunStart(t=t0, mode=mode, num_steps=num_steps, num_cells=3)]
    spans: list[tuple[float, float, str]] = []  # executions' (t_run, t_end, id) for observations
    queued: list[tuple[float, float]] = []
    switches: list[tuple[float, float, str]] = []  # cell 2's (t_start, t_end, switching role)
    t = t0
    for step in range(num_steps):
        execs = []
        for g in range(groups_per_step):
            for i in range(group_size):
                eid, t_run = f"s{step}g{g}e{i}", t + rng.uniform(0.2, 2.0)
                execs.append((eid, f"task{g}", f"s{step}g{g}", t_run, t_run + rng.uniform(20.0, 45.0)))
                queued.append((t, t_run))
        ends = sorted(e[4] for e in execs)
        t_switch = ends[int(0.6 * len(ends))]
        for eid, task, group, t_run, t_end in execs:
            events.append(
                ExecutionState(t=t, execution_id=eid, task_id=task, group_id=group, step=step, state="queued")
            )
            events.append(
                ExecutionState(t=t_run, execution_id=eid, task_id=task, group_id=group, step=step, state="running")
            )
            events += _calls(rng, eid, t_run, t_end, t_switch)
            timed_out = step > 0 and eid.endswith("g0e0")
            reward = 0.0 if timed_out else min(1.0, max(0.0, rng.gauss(0.3 + 0.12 * step, 0.2)))
            events.append(
                ExecutionState(
                    t=t_end,
                    execution_id=eid,
                    task_id=task,
                    group_id=group,
                    step=step,
                    state="timed_out" if timed_out else "finished",
                    reward=round(reward, 3),
                    reason="time_budget" if timed_out else None,
                    duration_s=t_end - t_run,
                )
            )
            spans.append((t_run, t_end, eid))
        events.append(
            RoleSwitchEvent(
                t=t_switch + TO_TRAIN_S,
                cell=2,
                from_role="rollout",
                to_role="train",
                t_start=t_switch,
                phases=_phases(Role.TO_TRAIN, TO_TRAIN_S),
            )
        )
        switches.append((t_switch, t_switch + TO_TRAIN_S, "to_train"))
        t = _train_step(rng, events, step, execs, t_ready=ends[-1] + 0.5, cell2_from=t_switch + TO_TRAIN_S)
        events.append(
            RoleSwitchEvent(
                t=t + TO_ROLLOUT_S,
                cell=2,
                from_role="train",
                to_role="rollout",
                t_start=t,
                phases=_phases(Role.TO_ROLLOUT, TO_ROLLOUT_S),
            )
        )
        switches.append((t, t + TO_ROLLOUT_S, "to_rollout"))
        events.append(WeightPublish(t=t + 1.2, version=step + 1, seconds=1.2, num_engines=2))
        if step % 2 == 1:
            events.append(Checkpoint(t=t + 2.0, step=step, path=f"checkpoints/step_{step}", seconds=2.0))
        if step == 1:
            events.append(
                FailureEvent(t=t - 5.0, component="engine e1", message="engine exited (code -9); 2 calls rerouted")
            )
        t += TO_ROLLOUT_S
    events += _observations(t0, t, spans, queued, switches)
    events += held_out_results(t0, t, num_steps)
    return sorted(events, key=lambda e: e.t)


HELD_OUT = {0: (0.2, 0.4, None), 1: (0.6, 1.0, 0.8)}
"""Held-out rewards under the first weights and under the last (index 1): None has no score."""


def held_out_results(t0: float, t1: float, num_steps: int) -> list[HeldOutResult]:
    return [
        HeldOutResult(
            t=(t0 if k == 0 else t1) + 5.0 + i,
            execution_id=f"heldout-v{k * num_steps}-{i}",
            task_id=f"held{i}",
            version=k * num_steps,
            outcome="finished" if r is not None else "evaluator_error",
            reward=r,
        )
        for k, rewards in HELD_OUT.items()
        for i, r in enumerate(rewards)
    ]


def _calls(rng: Random, eid: str, t_run: float, t_end: float, t_switch: float) -> list[ModelCall]:
    out, tc, n = [], t_run, 0
    while True:
        latency = rng.uniform(0.4, 2.0)
        tc += latency
        if tc > t_end:
            return out
        cell = rng.choice((1, 2)) if tc < t_switch else 1
        out.append(
            ModelCall(
                t=tc,
                execution_id=eid,
                agent_id="main" if n % 5 else "sub1",
                cell=cell,
                engine_id=f"e{cell}",
                prompt_tokens=2000 + 400 * n,
                output_tokens=rng.randint(50, 400),
                cached_tokens=1800 + 400 * n,
                latency_s=latency,
            )
        )
        n += 1
        tc += rng.uniform(0.3, 2.5)  # the tool call


def _train_step(rng: Random, events: list, step: int, execs: list, t_ready: float, cell2_from: float) -> float:
    """Micro-steps on the core and cell 2, then the optimizer step; returns when it was applied."""
    free = {0: t_ready, 2: max(t_ready, cell2_from)}
    for index in range(6):
        cell = min(free, key=free.get)
        seconds = rng.uniform(3.0, 5.0)
        free[cell] += seconds
        events.append(
            MicroStepEvent(
                t=free[cell], step=step, index=index, cell=cell, tokens=rng.randint(3000, 6000), seconds=seconds
            )
        )
    t_applied = max(free.values()) + 0.8
    rewards = [e.reward for e in events if isinstance(e, ExecutionState) and e.step == step and e.reward is not None]
    mean = sum(rewards) / len(rewards)
    naive = rng.randint(40_000, 60_000)
    events.append(
        OptimizerStep(
            t=t_applied,
            step=step,
            loss=round(0.05 - 0.01 * step + rng.uniform(-0.005, 0.005), 5),
            clip_fraction=0.02,
            truncated_fraction=0.001,
            ratio_mean=1.0,
            logprob_gap_mean=0.01 + 0.002 * step,
            kl_mean=0.0004 + 0.0001 * step,
            entropy_mean=0.9 - 0.05 * step,
            grad_norm=0.5 + rng.random(),
            reward_mean=mean,
            reward_std=(sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
            num_executions=len(rewards),
            targets_naive=naive,
            targets_capped=int(naive * 0.8),
            targets_dedup=int(naive * 0.55),
            seq_tokens_naive=naive * 20,
            seq_tokens_capped=naive * 16,
            seq_tokens_packed=naive * 11,
            seq_tokens_tree=naive * 7,
            seconds=t_applied - t_ready,
        )
    )
    for eid, task, group, _, _ in execs:
        if step > 0 and eid.endswith("g0e0"):
            events.append(
                ExecutionState(
                    t=t_applied,
                    execution_id=eid,
                    task_id=task,
                    group_id=group,
                    step=step,
                    state="excluded",
                    reason="timed_out",
                )
            )
            events.append(Exclusion(t=t_applied, execution_id=eid, reason="timed_out"))
        else:
            events.append(
                ExecutionState(t=t_applied, execution_id=eid, task_id=task, group_id=group, step=step, state="trained")
            )
    return t_applied


def _observations(t0: float, t1: float, spans, queued, switches) -> list[ObservationEvent]:
    out, t = [], t0
    while t <= t1:
        running = sum(a <= t < b for a, b, _ in spans)
        role2 = next((r for a, b, r in switches if a <= t < b), None)
        if role2 is None:
            last = [r for a, b, r in switches if b <= t]
            role2 = "train" if last and last[-1] == "to_train" else "rollout"
        sessions = [0, running - running // 2, running // 2] if role2 == "rollout" else [0, running, 0]
        out.append(
            ObservationEvent(
                t=t,
                queued=sum(a <= t < b for a, b in queued),
                running=running,
                roles=["train", "rollout", role2],
                sessions=sessions,
            )
        )
        t += 1.0
    return out
