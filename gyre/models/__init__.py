"""Models: the architecture family shared by the trainer (megatron-core) and the builtin engine."""
