"""`gyre-export CHECKPOINT OUT_DIR --model-path HF_DIR`: a trainer checkpoint back to a Hugging Face
directory (safetensors in the source's dtype, its config.json, tokenizer and generation files)
that `transformers`, SGLang and vLLM load.

The checkpoint's model tensors are read by megatron-core's dist_checkpointing into a one-rank
GPTModel (any TP size it was saved with is resharded on load), converted to engine names and
written with the source directory's non-weight files copied verbatim.
"""

import argparse
import os
import sys
from pathlib import Path

import torch

from gyre.errors import GyreError
from gyre.models.config import ModelConfig
from gyre.models.convert import megatron_to_engine
from gyre.models.hf import source_dtype, write_hf_dir


def load_trainer_weights(checkpoint: str | os.PathLike, model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Engine-named full weights from a trainer checkpoint directory (gyre/train/checkpoint.py)."""
    from gyre.train.config import TrainerConfig
    from gyre.train.model import build_gpt_model, init_distributed

    if not (Path(checkpoint) / "gyre_state.json").is_file():
        raise GyreError(f"{checkpoint} is not a complete trainer checkpoint (no gyre_state.json)")
    init_distributed(1, seed=0)  # first: on CPU it imports megatron-core (gyre.train.cpu_shim)
    from megatron.core import dist_checkpointing

    bare = ModelConfig(**{f: getattr(model_cfg, f) for f in model_cfg.__dataclass_fields__ if f != "path"})
    model = build_gpt_model(bare, TrainerConfig())  # random init: every tensor is overwritten below
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(prefix="")}, str(checkpoint))
    model.load_state_dict(loaded["model"], strict=False)
    state = {n: p.detach() for n, p in model.named_parameters()}
    return megatron_to_engine(state, bare)


def export(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, model_path: str | os.PathLike) -> Path:
    """Write `checkpoint`'s weights as an HF directory at `out_dir` shaped and tokenized like `model_path`."""
    cfg = ModelConfig(name="export", path=str(model_path))
    weights = load_trainer_weights(checkpoint, cfg)
    write_hf_dir(out_dir, cfg, weights, dtype=source_dtype(model_path), source=model_path)
    return Path(out_dir)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="gyre-export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoint", help="a trainer checkpoint directory (…/step_00000012)")
    p.add_argument("out_dir", help="where to write the Hugging Face directory")
    p.add_argument(
        "--model-path", required=True, help="the HF directory training started from (architecture, tokenizer, dtype)"
    )
    a = p.parse_args(argv)
    try:
        out = export(a.checkpoint, a.out_dir, a.model_path)
    except (GyreError, OSError, ValueError) as e:
        sys.exit(f"gyre-export: {e}")
    print(out)


if __name__ == "__main__":
    main()
