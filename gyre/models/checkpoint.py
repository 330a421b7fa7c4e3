"""Engine weights on disk: a directory with `model.safetensors` (HF/Qwen2 names) and `config.json`.

This is the layout `/update_weights_from_disk` and `gyre-engine` take, the same way SGLang takes a
model directory. `config.json` carries Gyre's ModelConfig fields.
"""

import dataclasses
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gyre.models.config import ModelConfig
from gyre.models.transformer import check_weights


def save_checkpoint(path: str | os.PathLike, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Write the directory atomically per file (temp file, then rename), so readers never see halves."""
    check_weights(cfg, weights)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.detach().contiguous().cpu() for n, t in weights.items()}
    for name, write in (
        ("model.safetensors", lambda f: save_file(tensors, f)),
        ("config.json", lambda f: Path(f).write_text(json.dumps(dataclasses.asdict(cfg), indent=1))),
    ):
        fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
        os.close(fd)
        write(tmp)
        os.replace(tmp, out / name)


def load_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a directory written by `save_checkpoint`.

    Raises:
        FileNotFoundError: the directory or one of its two files is missing.
        ValueError: the weights do not match config.json.
    """
    d = Path(path)
    for name in ("config.json", "model.safetensors"):
        if not (d / name).is_file():
            raise FileNotFoundError(f"{d / name} not found: a model directory needs config.json and model.safetensors")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    raw = json.loads((d / "config.json").read_text())
    cfg = ModelConfig(**{k: v for k, v in raw.items() if k in fields})
    weights = load_file(str(d / "model.safetensors"))
    check_weights(cfg, weights)
    return cfg, weights
