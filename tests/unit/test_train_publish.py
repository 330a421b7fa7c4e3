"""Engines get weights in the served dtype (bf16 on CUDA), not the trainer's fp32 masters."""

from types import SimpleNamespace

import torch
from safetensors import safe_open

from gyre.models.config import ModelConfig
from gyre.models.transformer import init_weights
from gyre.train.publish import WeightPublisher, served_dtype

MODEL = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=48, num_attention_heads=2, num_query_groups=1)


def test_the_served_dtype_is_bf16_on_cuda_and_fp32_on_cpu():
    assert served_dtype(cuda=True) == torch.bfloat16 and served_dtype(cuda=False) == torch.float32


def test_a_published_model_directory_holds_the_served_dtype(tmp_path):
    weights = init_weights(MODEL, seed=1)
    core = SimpleNamespace(publish=lambda: (3, None), published_tensors=lambda version: weights)
    published = WeightPublisher(core, "disk", MODEL, str(tmp_path), "127.0.0.1", dtype=torch.bfloat16).publish()
    with safe_open(f"{published.source['path']}/model.safetensors", framework="pt") as st:
        loaded = {name: st.get_tensor(name) for name in st.keys()}
    assert published.version == 3 and {t.dtype for t in loaded.values()} == {torch.bfloat16}
    assert torch.equal(loaded["model.embed_tokens.weight"], weights["embed_tokens.weight"].to(torch.bfloat16))
