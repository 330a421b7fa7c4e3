"""Both megatron-core layer specs' parameter names map to engine names and back: the local spec (CPU,
names read from a real model) and the TransformerEngine spec (CUDA; TE does not install here, so its
names are written out below from megatron-core 0.16.1's gpt_layer_specs.py)."""

import pytest
import torch

from gyre.models.config import ModelConfig
from gyre.models.convert import engine_to_megatron, local_spec_name, megatron_to_engine, te_spec_name
from gyre.models.transformer import init_weights
from gyre.train.config import TrainerConfig
from gyre.train.trainer import Trainer

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=32,
    qk_norm=True,
    vocab_size=64,
    max_seq_len=128,
)

TE_LAYER = (  # get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True), dense, no MLA
    "self_attention.linear_qkv.layer_norm_weight",  # TELayerNormColumnParallelLinear: the fused input norm
    "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight",  # TERowParallelLinear
    "self_attention.q_layernorm.weight",  # TENorm (for_qk)
    "self_attention.k_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight",  # TELayerNormColumnParallelLinear: the fused pre-MLP norm
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
)  # input_layernorm and pre_mlp_layernorm are IdentityOp: no parameters
TE_NAMES = sorted(
    ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    + [f"decoder.layers.{i}.{n}" for i in range(MODEL.num_layers) for n in TE_LAYER]
)


@pytest.fixture(scope="module")
def local_model_state():
    torch.set_num_threads(1)
    trainer = Trainer(MODEL, TrainerConfig(lr=1e-3), seed=3)
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer


def test_the_te_specs_names_map_to_the_local_specs_and_back(local_model_state):
    state, _ = local_model_state
    assert sorted(local_spec_name(n) for n in TE_NAMES) == sorted(state)
    assert sorted(te_spec_name(n) for n in state) == TE_NAMES
    assert all(te_spec_name(local_spec_name(n)) == n for n in TE_NAMES)


@pytest.mark.parametrize("te", [False, True], ids=["local-spec", "te-spec"])
def test_a_checkpoint_round_trips_through_either_spec(local_model_state, te):
    state, _ = local_model_state
    engine = init_weights(MODEL, seed=5)
    megatron = engine_to_megatron(engine, MODEL, te=te)
    assert sorted(megatron) == (TE_NAMES if te else sorted(state))
    back = megatron_to_engine(megatron, MODEL)
    assert sorted(back) == sorted(engine) and all(torch.equal(back[n], engine[n]) for n in engine)


def test_a_model_loads_engine_weights_by_either_specs_names_and_exports_them_unchanged(local_model_state):
    """load_full_weights looks each model parameter up under its local-spec name, so a TE model
    (whose names are TE_NAMES) loads from the same converted state; here the local model does."""
    _, trainer = local_model_state
    engine = init_weights(MODEL, seed=7)
    trainer.load_engine_weights(engine)
    out = trainer.engine_weights()
    assert all(torch.equal(out[n], engine[n]) for n in engine)
    te_state = {te_spec_name(n): p.detach() for n, p in trainer.model.named_parameters()}
    assert all(torch.equal(t, engine[n]) for n, t in megatron_to_engine(te_state, MODEL).items())
