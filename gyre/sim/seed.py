"""The seed's reported speedups, and the simulated scenarios shaped like each of its runs."""

from dataclasses import dataclass


@dataclass(frozen=True)
class SeedRow:
    """One row of the seed's table and the scenario(s) that mirror it (one per cluster preset)."""

    workload: str
    profile: str
    presets: tuple[str, ...]
    num_steps: int
    vs_async: str
    vs_colocate: str
    overrides: tuple[str, ...] = ()


SEED_ROWS = (
    SeedRow(
        "NL2RepoBench, 122B, 48 steps", "nl2repo", ("qwen122b_24n", "qwen122b_32n"), 48, "1.42-1.53x", "1.36-1.47x"
    ),
    SeedRow("DeepSWE, 122B, 24 steps", "deepswe", ("qwen122b_24n", "qwen122b_32n"), 24, "1.57x", "1.61-1.82x"),
    SeedRow(
        "TerminalBench, 122B, 24 steps",
        "terminalbench",
        ("qwen122b_24n", "qwen122b_32n"),
        24,
        "1.38-1.43x",
        "1.81-1.85x",
    ),
    SeedRow(
        "NL2RepoBench, 2.4T (4 cells x 48), 48 steps",
        "nl2repo",
        ("qwen2t4_192n",),
        48,
        "1.78x (75.42 h vs 134.55 h)",
        "1.21x (vs 91.47 h)",
    ),
)
"""The seed's four benchmark rows (equal GPU budget, matched staleness, Claude Code 2.1.220)."""
