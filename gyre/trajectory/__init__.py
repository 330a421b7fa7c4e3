"""Trajectory processor: from an execution's records to packed training samples (pure, no I/O).

tree.py (call tree from token prefixes) -> paths.py (classify, select K, per-token targets, shared
targets) -> rewards.py (reward rules, GRPO advantages) -> process.py (one execution, one group,
loss weights) -> pack.py (PackedBatch rows, sample.py's contract). config.py: TrajectoryConfig.
Harness-shaped synthetic executions for tests and benchmarks are test data (tests/unit/_synthetic.py).
"""
