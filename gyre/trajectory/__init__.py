"""Trajectory processor: from an execution's records to packed training samples (pure, no I/O)."""
