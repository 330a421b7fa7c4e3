"""The coordinator: one RL run from admission to checkpoint (entry loop: loop.py)."""
