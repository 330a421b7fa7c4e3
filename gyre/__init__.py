"""Gyre: Slurm-native online RL for coding agents, with elastic rollout/train cells."""

__version__ = "0.1.0"
