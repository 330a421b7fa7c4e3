"""Training: the megatron-core policy model, the policy loss, core/satellite micro-steps, checkpoints.

Submodules import megatron-core lazily (only `model`, `trainer`, `checkpoint`, `elastic` need it), so
reading the config stays cheap.
"""
