"""Models: the architecture family shared by the trainer (megatron-core) and the builtin engine.

`config` (shapes), `transformer` (named weights, init, functional forward, reference log-probs),
`checkpoint` (safetensors + config.json directories), `tokenizer` (byte/HF tokenizers, chat template).
"""
