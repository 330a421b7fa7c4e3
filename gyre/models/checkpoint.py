"""Engine weights on disk: a Hugging Face directory (model.safetensors + config.json).

This is the layout `/update_weights_from_disk` and `gyre-engine` take, the same way SGLang and
`transformers` take a model directory: the trainer's published weights can be served by either
engine. gyre/models/hf.py holds the name and config mapping.
"""

import os
from pathlib import Path

import torch

from gyre.models.config import ModelConfig
from gyre.models.hf import read_hf_config, read_hf_weights, write_hf_dir
from gyre.models.transformer import check_weights


def save_checkpoint(
    path: str | os.PathLike, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: str = "float32"
) -> None:
    """Write the directory (its tensors in `dtype`) atomically per file (temp file, then rename), so
    readers never see halves.

    A model loaded from an HF directory (`cfg.path`) keeps that directory's config.json and
    tokenizer files, so SGLang serves the published weights exactly as it served the original.
    """
    check_weights(cfg, weights)
    write_hf_dir(path, cfg, weights, dtype=dtype, source=cfg.path)


def load_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read an HF directory (written by `save_checkpoint` or a released checkpoint) as fp32 engine weights.

    Raises:
        FileNotFoundError: the directory, its config.json or its safetensors are missing.
        ConfigError (a ValueError): config.json names an architecture Gyre does not run.
        ValueError: the weights do not match config.json.
    """
    d = Path(path)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d / 'config.json'} not found: a model directory needs config.json and *.safetensors")
    cfg = ModelConfig(name=d.name, **read_hf_config(d))
    weights = read_hf_weights(d, cfg)
    check_weights(cfg, weights)
    return cfg, weights
