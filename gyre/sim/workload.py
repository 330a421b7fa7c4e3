"""Workload draws: each step's executions as segments of generated tokens and tool wall time.

Draws depend only on (seed, step), never on the mode, so every mode runs the very same
executions (common random numbers): differences between modes are the scheduler's alone.
"""

from dataclasses import dataclass, field

import numpy as np

from gyre.sim.config import PresetConfig, ProfileConfig

GEN_TOKENS_SIGMA = 0.5
"""Log-normal sigma of tokens generated per segment (assumed; not a profile knob)."""


@dataclass
class Batch:
    """One step's executions; per-segment values are flat lists indexed from `offsets`."""

    step: int
    segments: list[int]
    offsets: list[int]
    gen_tokens: list[float]
    tool_s: list[float]
    excluded: list[bool]
    longest_s: float = 0.0
    """Duration of its longest execution on an unloaded engine, capped at the time budget (0 when
    drawn without a session speed)."""
    group_longest_s: list[float] = field(default_factory=list)
    """Per group, the same for its longest execution: the earliest the group can be ready after
    the batch is admitted (empty when drawn without a session speed)."""


def draw_batch(
    profile: ProfileConfig, step: int, seed: int, tail_scale: float = 1.0, session_tok_s: float = 0.0
) -> Batch:
    """Draw step `step`'s executions (group-major: group g owns executions g*G .. g*G+G-1).

    Args:
        tail_scale: multiplies `segments_sigma`, thickening the duration tail (sensitivity).
    """
    rng = np.random.default_rng([seed, step])
    n = profile.executions_per_step
    task = np.repeat(
        rng.lognormal(0.0, profile.segments_sigma * tail_scale, profile.groups_per_step), profile.group_size
    )
    spread = task * rng.lognormal(0.0, profile.exec_sigma, n)
    base = rng.choice(profile.segments_samples, n) if profile.segments_samples else profile.segments_median
    segs = np.clip(np.rint(base * spread), 1, profile.max_segments)
    segs = segs.astype(np.int64)
    total = int(segs.sum())
    gen = _draw(rng, profile.gen_tokens_samples, profile.gen_tokens_median, GEN_TOKENS_SIGMA, total)
    tool = _draw(rng, profile.tool_s_samples, profile.tool_s_median, profile.tool_s_sigma, total)
    offsets = np.concatenate(([0], np.cumsum(segs)[:-1]))
    excluded = rng.random(n) < profile.excluded_fraction
    longest, group_longest = 0.0, []
    if session_tok_s > 0:
        unloaded = np.minimum(profile.timeout_s, np.add.reduceat(gen / session_tok_s + tool, offsets))
        group_longest = unloaded.reshape(profile.groups_per_step, profile.group_size).max(axis=1).tolist()
        longest = max(group_longest)
    return Batch(
        step, segs.tolist(), offsets.tolist(), gen.tolist(), tool.tolist(), excluded.tolist(), longest, group_longest
    )


def _draw(rng, samples: list[float], median: float, sigma: float, n: int) -> np.ndarray:
    """`n` values: bootstrapped from measured `samples` when given, else log-normal around `median`."""
    if samples:
        return rng.choice(np.asarray(samples, dtype=float), n)
    return median * rng.lognormal(0.0, sigma, n)


def prompt_tokens(profile: ProfileConfig, gen_tokens: float) -> float:
    """New prompt tokens a segment's model call prefills: the context it adds beyond its own output
    (tool results, instructions)."""
    return max(0.0, profile.context_tokens_per_segment - gen_tokens)


def budget_hit_fraction(profile: ProfileConfig, session_tok_s: float, seed: int, steps: int = 4) -> float:
    """Share of executions whose unloaded duration (decode at `session_tok_s` + tool time)
    reaches the time budget: the profile's budget-hit rate at this model's speed, before queueing."""
    hit = total = 0
    for step in range(steps):
        b = draw_batch(profile, step, seed)
        d = np.add.reduceat(np.asarray(b.gen_tokens) / session_tok_s + np.asarray(b.tool_s), b.offsets)
        hit += int((d >= profile.timeout_s).sum())
        total += len(d)
    return hit / total


def train_tokens(profile: ProfileConfig, segments_done: int) -> int:
    """Tokens trained for an execution that completed `segments_done` segments."""
    return int(context_tokens(profile, segments_done) * profile.train_token_factor)


def context_tokens(profile: ProfileConfig, segments_done: int) -> float:
    """Context of an execution after `segments_done` segments, tokens (capped by compaction)."""
    return min(segments_done * profile.context_tokens_per_segment, profile.max_context_tokens)


def mean_context_tokens(profile: ProfileConfig, seed: int) -> float:
    """Mean context of a model call over step 0's draw (the KV a call needs, its output included):
    what a live session's KV costs on average. Contexts grow through an execution, so this is
    about half the mean final context, weighted toward long executions (they make more calls)."""
    b = draw_batch(profile, 0, seed)
    total = sum(sum(context_tokens(profile, j + 1) for j in range(n)) for n in b.segments)
    return total / sum(b.segments)


def train_share(
    profile: ProfileConfig, preset: PresetConfig, seed: int, train_tok_s_per_node: float, prefill_tok_s_per_node: float
) -> float:
    """Expected fraction of node-seconds that training takes (sizes async's work_share pools),
    from step 0's draw.

    Rollout node-seconds count the binding resource: decode plus prefill compute, or KV slots
    held for the execution's unloaded duration (tool calls included).
    """
    b = draw_batch(profile, 0, seed)
    ctx = mean_context_tokens(profile, seed)
    per_node = preset.sessions_per_node(ctx) + preset.pooled_sessions(ctx) / preset.num_nodes
    full_speed_s = [
        min(
            profile.timeout_s,
            sum(g / preset.session_tok_s + t for g, t in zip(b.gen_tokens[o : o + n], b.tool_s[o : o + n])),
        )
        for o, n in zip(b.offsets, b.segments)
    ]
    prefill = sum(prompt_tokens(profile, g) for g in b.gen_tokens)
    compute_s = sum(b.gen_tokens) / preset.gen_tok_s_per_node + prefill / prefill_tok_s_per_node
    gen_node_s = max(compute_s, sum(full_speed_s) / per_node)
    train_node_s = sum(train_tokens(profile, s) for s in b.segments) / train_tok_s_per_node
    return train_node_s / (train_node_s + gen_node_s)
