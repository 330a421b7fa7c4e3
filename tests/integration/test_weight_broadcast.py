"""Weights from the trainer to SGLang by `/update_weights_from_distributed`: the trainer's rank 0
forms SGLang's weight group and broadcasts each tensor while the engine receives. On CPU over gloo
against SGLang's two routes as its model runner serves them (sglang_weights_fake.py); over NCCL
against a real SGLang server where a GPU and sglang exist."""

import asyncio
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from gyre.common.serve import ChildServer
from gyre.engines.client import EngineClient
from gyre.engines.launch import free_port
from gyre.models.config import ModelConfig
from gyre.models.hf import hf_name
from gyre.train.config import TrainerConfig
from gyre.train.publish import broadcast_weights, connect_weight_group
from gyre.train.trainer import Trainer
from tests.integration.engine_fixtures import start_sglang

FAKE = Path(__file__).with_name("sglang_weights_fake.py")
MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=64,
    max_seq_len=64,
)


async def _connect_and_push(url: str, trainer: Trainer, backend: str, group_name: str) -> tuple[list[dict], dict]:
    async with EngineClient(url, timeout_s=120) as c:
        group = await connect_weight_group([c], [1], "127.0.0.1", free_port(), group_name=group_name, backend=backend)
        try:
            replies = await broadcast_weights(trainer, group, [c], group_name=group_name)
            embed = (
                await c.post("/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 4})
                if backend == "nccl"
                else None
            )
        finally:
            dist.destroy_process_group(group)
        return replies, {"weight_version": c.weight_version, "embed": embed}


def test_the_trainer_broadcasts_every_tensor_under_its_hf_name_in_bf16(tmp_path):
    fake = ChildServer("sglang-weights-fake")
    port = fake.spawn_and_wait_port([sys.executable, str(FAKE), "--out", str(tmp_path / "got.safetensors")], 60)[0]
    trainer = Trainer(MODEL, TrainerConfig(), seed=3)
    trainer.step = 4
    try:
        replies, seen = asyncio.run(_connect_and_push(f"http://127.0.0.1:{port}", trainer, "gloo", "gyre-test"))
    finally:
        fake.stop()
    assert replies[0]["success"] and seen["weight_version"] == 4
    got, sent = load_file(tmp_path / "got.safetensors"), trainer.engine_weights()
    assert (
        set(got) == {hf_name(n) for n in sent}
        and "model.layers.1.mlp.gate_proj.weight" in got
        and "lm_head.weight" in got
    )
    assert all(
        got[hf_name(n)].dtype == torch.bfloat16 and torch.equal(got[hf_name(n)], t.to(torch.bfloat16))
        for n, t in sent.items()
    )


@pytest.mark.gpu
def test_sglang_receives_the_trainers_weights_over_nccl():
    """Needs sglang, GYRE_SGLANG_MODEL (an HF directory; SGLang starts with dummy weights) and two
    GPUs: NCCL refuses two ranks of one communicator on one device, so SGLang serves from GPU 1."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (the trainer on GPU 0, SGLang on GPU 1)")
    proc = start_sglang(extra_args=["--base-gpu-id", "1"])
    try:
        trainer = Trainer(ModelConfig(path=proc.cfg.model_path), TrainerConfig(bf16=True), seed=3)
        trainer.step = 1
        replies, seen = asyncio.run(_connect_and_push(proc.url, trainer, "nccl", "gyre"))
    finally:
        proc.stop()
    assert replies[0]["success"] and seen["weight_version"] == 1
    want = trainer.engine_weights()["embed_tokens.weight"][:4].to(torch.bfloat16).float()
    assert torch.equal(
        torch.tensor(seen["embed"], dtype=torch.float32).reshape(want.shape[0], -1)[:, : want.shape[1]], want
    )
