"""Models: the architecture family shared by the trainer (megatron-core) and the builtin engine.

`config` (shapes), `transformer` (named weights, init, functional forward, reference log-probs),
`hf` (Hugging Face config.json and tensor names), `checkpoint` (HF directories for engines),
`convert` (Megatron <-> engine names), `tokenizer` (byte/HF tokenizers, chat template). Tools that
need the trainer too live in gyre.train: `export` (`gyre-export`) and `hf_check`.
"""
