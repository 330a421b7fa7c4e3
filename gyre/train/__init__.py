"""Training: the megatron-core policy model, the policy loss, core/satellite micro-steps, checkpoints,
and the tools that need the trainer: `export` (`gyre-export`: trainer checkpoint -> HF directory) and
`hf_check` (parity of the trainer's and the engine's forwards with `transformers`).

Submodules import megatron-core lazily (only `model`, `trainer`, `checkpoint`, `elastic` need it), so
reading the config stays cheap.
"""
