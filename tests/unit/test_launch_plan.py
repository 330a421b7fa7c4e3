"""The GPU memory plan (gyre.launch.memory) and `gyre-plan` on Qwen3 shapes, from config.json alone."""

import json

import hydra
import pytest

from gyre.common import CONF_DIR
from gyre.config import register_configs, validate
from gyre.errors import ConfigError
from gyre.launch.memory import GpuShape, kv_bytes_per_token, plan_memory, rank_params
from gyre.launch.plan import check_gpu_plan, main
from gyre.models.config import ModelConfig

_QWEN3 = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    hidden_act="silu",
    attention_bias=False,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000,
    rms_norm_eps=1e-6,
)
QWEN3 = {  # the published config.json sizes (Hugging Face Qwen/Qwen3-*)
    "0.6B": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16)
    | dict(num_key_value_heads=8, tie_word_embeddings=True),
    "8B": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32)
    | dict(num_key_value_heads=8, tie_word_embeddings=False),
    "32B": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64)
    | dict(num_key_value_heads=8, tie_word_embeddings=False),
}
PARAMS_B = {"0.6B": 0.596, "8B": 8.19, "32B": 32.76}
"""Parameter counts as Hugging Face reports them (model cards: 0.6B, 8.2B, 32.8B)."""


def _model_dir(tmp_path, size: str) -> str:
    d = tmp_path / size
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(QWEN3[size]))
    return str(d)


@pytest.mark.parametrize("size", list(QWEN3), ids=list(QWEN3))
def test_the_plan_counts_the_published_parameters_and_splits_them_over_tp(tmp_path, size):
    model = ModelConfig(name="hf", path=_model_dir(tmp_path, size))
    assert rank_params(model, 1) / 1e9 == pytest.approx(PARAMS_B[size], rel=0.01)
    # TP shards everything but the norms: 8 ranks hold a little more than an eighth each
    assert rank_params(model, 1) / 8 < rank_params(model, 8) < rank_params(model, 1) / 8 * 1.001
    # SGLang replicates KV heads beyond their count: TP 16 over 8 KV heads keeps one per rank
    assert kv_bytes_per_token(model, 16) == kv_bytes_per_token(model, 8)


def _shape(model: ModelConfig, **over) -> GpuShape:
    fields = dict(
        model=model,
        trainer_tp=1,
        data_parallel=1,
        core_slots=0,
        micro_batch_tokens=8192,
        engine_tp=1,
        engine_on_gpu=True,
        mem_fraction_static=0.85,
        context_len=32768,
        capacity_bytes=80 * 10**9,
    )
    return GpuShape(**(fields | over))


@pytest.mark.parametrize(
    "size, over, fits, key",
    [
        pytest.param("0.6B", {}, True, None, id="0.6B-one-gpu"),
        pytest.param("8B", {}, False, "trainer.tensor_parallel_size", id="8B-one-gpu-trains-out-of-memory"),
        pytest.param("8B", dict(trainer_tp=8, data_parallel=6, core_slots=4), True, None, id="8B-tp8-dp6-core"),
        # today's trainer keeps four fp32 gradient buffers and the core five slots: 32B needs > 80 GB
        pytest.param(
            "32B", dict(trainer_tp=8, engine_tp=8, data_parallel=6), False, "trainer.tensor_parallel_size", id="32B-tp8"
        ),
        pytest.param("32B", dict(trainer_tp=8), False, "engine.tp_size", id="32B-engine-on-one-gpu"),
        pytest.param(
            "8B",
            dict(trainer_tp=8, mem_fraction_static=0.99),
            False,
            "engine.mem_fraction_static",
            id="serving-overfull",
        ),
    ],
)
def test_each_role_fits_the_gpu_or_the_plan_names_the_keys(tmp_path, size, over, fits, key):
    plan = plan_memory(_shape(ModelConfig(name="hf", path=_model_dir(tmp_path, size)), **over))
    assert plan.fits is fits and (key in plan.keys if key else not plan.keys)
    # the engine's static pool is its weights and KV: mem_fraction_static of the GPU, as in SGLang
    engine = plan.engine
    assert engine["kv"] == 0 or engine["weights"] + engine["kv"] == int(over.get("mem_fraction_static", 0.85) * 80e9)


def test_the_core_holds_the_satellites_slots_and_data_parallel_shards_the_optimizer(tmp_path):
    model = ModelConfig(name="hf", path=_model_dir(tmp_path, "8B"))
    alone, core = plan_memory(_shape(model, trainer_tp=8)), plan_memory(_shape(model, trainer_tp=8, core_slots=4))
    assert alone.trainer["grad_slots"] == 0 and core.trainer["grad_slots"] == 5 * alone.trainer["weights"]
    dp6 = plan_memory(_shape(model, trainer_tp=8, data_parallel=6))
    assert dp6.trainer["optimizer"] == alone.trainer["optimizer"] // 6
    assert dp6.trainer["gradients"] == alone.trainer["gradients"] // 3 * 4  # fold's broadcast buffer


def _plan(capsys, tmp_path, size: str, *more: str) -> tuple[int, dict, str]:
    rc = main(
        ["model=hf", f"model.path={_model_dir(tmp_path, size)}", "cluster=slurm", "cluster.cell_nodes=1"] + list(more)
    )
    out = capsys.readouterr().out
    return rc, json.loads(out.strip().splitlines()[-1]), out


def test_gyre_plan_fits_qwen3_0_6b_on_one_gpu_and_refuses_32b_naming_a_key(tmp_path, capsys):
    rc, summary, _ = _plan(capsys, tmp_path, "0.6B", "cluster.gpus_per_node=1")
    assert rc == 0 and summary["fits"] and summary["ranks_per_node"] == 1 and summary["devices"] == [0]
    assert summary["gpu_capacity_bytes"] == 80 * 10**9
    assert set(summary["gpu_bytes"]["trainer"]) >= {"weights", "gradients", "optimizer", "activations"}
    assert set(summary["gpu_bytes"]["engine"]) >= {"weights", "kv"}
    rc, summary, out = _plan(capsys, tmp_path, "32B", "cluster.gpus_per_node=1")
    assert rc == 1 and not summary["fits"] and "trainer.tensor_parallel_size" in out
    # an SGLang cell of 8 GPUs a node: needs no SGLang here, plans its engines too
    rc, summary, _ = _plan(
        capsys,
        tmp_path,
        "8B",
        "engine=sglang",
        "engine.mooncake_master=m:1",
        "engine.tp_size=8",
        "trainer.tensor_parallel_size=8",
    )
    assert rc == 0 and summary["devices"] == list(range(8)) and summary["gpu_bytes"]["engine"]["kv"] > 0


def test_gyre_train_checks_the_plan_on_a_gpu_cluster_only(tmp_path):
    register_configs()

    def config(*overrides):
        with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return validate(hydra.compose(config_name="config", overrides=list(overrides)))

    big = ["model=hf", f"model.path={_model_dir(tmp_path, '32B')}", "cluster=slurm", "cluster.cell_nodes=1"]
    with pytest.raises(ConfigError) as err:
        check_gpu_plan(config(*big, "cluster.gpus_per_node=1"))
    assert err.value.key == "trainer.tensor_parallel_size"
    check_gpu_plan(config(*big, "cluster.gpus_per_node=0"))  # a CPU cluster is not planned
    check_gpu_plan(config())  # nor the local default
