"""The SGLang path on CPU, against the contract fake (gyre.engines.sglang_fake) started as SGLang
would be (SGLangProcess, sglang.launch_server's flags): it answers in SGLang's shapes, refuses
Gyre's own routes, and takes the core's weights through `update_weights_from_distributed` over
gloo (engine.weight_sync=distributed) with the engine's log-probs then equal to the trainer's. The
same load against a real SGLang server over NCCL where a GPU and sglang exist."""

import asyncio
import threading

import pytest
import torch

from gyre.engines.client import EngineClient, EngineHTTPError
from gyre.engines.config import EngineConfig
from gyre.engines.launch import SGLangProcess
from gyre.engines.weights import load_weights
from gyre.models.checkpoint import save_checkpoint
from gyre.models.config import ModelConfig
from gyre.models.transformer import init_weights
from gyre.train.config import TrainerConfig
from gyre.train.elastic import CoreServer
from gyre.train.publish import WeightPublisher
from gyre.train.trainer import Trainer
from gyre.trajectory.pack import pack
from gyre.transfer import TransferEndpoint
from tests.integration.engine_fixtures import start_sglang
from tests.unit._train_ref import as_samples

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=300,
    max_seq_len=128,
)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    """The fake on a tiny HF directory, started with dummy (random) weights, as SGLang would be."""
    model_dir = tmp_path_factory.mktemp("model")
    save_checkpoint(model_dir, MODEL, init_weights(MODEL, 5))
    cfg = EngineConfig(
        backend="sglang",
        sglang_fake=True,
        model_path=str(model_dir),
        load_format="dummy",
        enable_hicache=False,
        weight_sync="distributed",
        weight_version=0,
        startup_timeout_s=120,
    )
    with SGLangProcess(cfg) as proc:
        yield proc


def _run(coro_fn, url):
    async def go():
        async with EngineClient(url, timeout_s=120) as c:
            return await coro_fn(c)

    return asyncio.run(go())


def test_the_fake_answers_in_sglangs_shapes_and_refuses_gyres_own_routes(fake):
    async def probe(c: EngineClient) -> dict:
        out = {"gen": await c.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0.0})}
        out["begin"] = await c.begin_weight_update()  # the session SGLang 0.5.21 loads tensors in
        for path, body in [
            ("/gyre/export_kv", {"sessions": [{"input_ids": PROMPT, "kv_from": 0}]}),
            ("/update_weights_from_tensor", {"load_format": "gyre_transfer", "session_id": "x", "address": 1}),
            ("/update_weights_from_tensor", {"load_format": "gyre_transfer", "serialized_named_tensors": ["x"]}),
            ("/generate", {"input_ids": "not ids"}),
            ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [], "group_name": "nope"}),
        ]:
            with pytest.raises(EngineHTTPError) as e:
                await c.post(path, body)
            out[path + str(len(out))] = (e.value.status, e.value.body)
        out["end"] = await c.end_weight_update()
        out["abort"] = await c.abort(abort_all=True)
        out["pause"], out["continue"] = await c.pause("abort"), await c.resume()
        out["flush"] = await c.flush_cache()
        out["release"], out["resume"] = await c.release_memory(), await c.resume_memory()
        out["info"] = await c.model_info()
        return out

    out = _run(probe, fake.url)
    meta = out["gen"]["meta_info"]
    assert "weight_version_spans" not in meta and meta["weight_version"] == "0"
    assert set(meta) >= {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"}
    statuses = [v for k, v in out.items() if k.startswith("/")]
    assert statuses[0] == (404, '{"detail": "Not Found"}')
    assert statuses[1][0] == 400 and '"code": 400' in statuses[1][1] and "serialized_named_tensors" in statuses[1][1]
    assert statuses[2] == (400, '{"success": false, "message": "Unknown load_format=gyre_transfer"}')
    assert statuses[3][0] == 400 and statuses[3][1].startswith('{"error": {"message": "input_ids')
    assert statuses[4][0] == 400 and "init_weights_update_group" in statuses[4][1]
    assert out["begin"] == {"success": True, "message": "Success"} == out["end"]
    assert out["abort"] == "" and out["pause"]["status"] == "ok" == out["continue"]["status"]
    assert out["flush"].startswith("Cache flushed.") and out["release"] is None and out["resume"] is None
    assert out["info"]["weight_version"] == "0" and out["info"]["is_generation"] is True


def _gap(trainer: Trainer, answer: dict) -> float:
    lps = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
    batch = pack(as_samples([{"prompt": PROMPT, "output": answer["output_ids"], "logprobs": lps, "advantage": 1.0}]))
    return float((trainer.logprobs(batch) - batch.behaviour_logprobs)[batch.target_mask].abs().max())


def _in_session(url: str, weights) -> dict:
    """Load `weights` inside the weight-update session SGLang 0.5.21 requires (begin, load, end)."""

    async def go(c: EngineClient) -> dict:
        await c.begin_weight_update()
        try:
            return await load_weights(c, weights)
        finally:
            await c.end_weight_update()

    return _run(go, url)


def test_the_core_publishes_to_sglang_by_update_weights_from_distributed(fake):
    """weight_sync=distributed: the first load forms the weight group (init_weights_update_group),
    later ones reuse it; each makes the fake serve the core's published version exactly, the second
    after a round trip through training (SGLangProcess.release: pause, release memory; .resume).
    Each load runs in the session SGLang 0.5.21 requires (/begin_weight_update, /end_weight_update)."""
    torch.set_num_threads(1)
    trainer = Trainer(MODEL, TrainerConfig(lr=1e-2), seed=3)
    endpoint = TransferEndpoint()
    core = CoreServer(trainer, endpoint)
    publisher = WeightPublisher(core, "distributed", MODEL, "", "127.0.0.1")
    generate = lambda c: c.generate(PROMPT, {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 1})  # noqa: E731
    try:
        v0 = publisher.publish()
        reply0 = _in_session(fake.url, v0)
        out0 = _run(generate, fake.url)
        gap0 = _gap(trainer, out0)
        lps = [lp for lp, _, _ in out0["meta_info"]["output_token_logprobs"]]
        seq = {"prompt": PROMPT, "output": out0["output_ids"], "logprobs": lps, "advantage": 1.0}
        core.begin_step()
        core.add_micro_batch(pack(as_samples([seq])))
        step = threading.Thread(target=core.run_step)
        step.start()
        core.end_step()
        step.join(timeout=120)
        v1 = publisher.publish()
        _run(fake.release, fake.url)
        _run(fake.resume, fake.url)
        reply1 = _in_session(fake.url, v1)
        out1 = _run(generate, fake.url)
    finally:
        publisher.close()
        core.close()
        endpoint.close()
    assert v0.sync == "distributed" and (v0.version, v1.version) == (0, 1)
    assert reply0["success"] and reply1["message"].endswith("Weight version updated to 1.")
    assert out0["meta_info"]["weight_version"] == "0" and out1["meta_info"]["weight_version"] == "1"
    assert gap0 <= 1e-4 and _gap(trainer, out1) <= 1e-4


@pytest.mark.gpu
def test_sglang_receives_the_cores_weights_over_nccl():
    """Needs sglang, GYRE_SGLANG_MODEL (an HF directory; SGLang starts with dummy weights) and two
    GPUs: NCCL refuses two ranks of one communicator on one device, so SGLang serves from GPU 1."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (the trainer on GPU 0, SGLang on GPU 1)")
    proc = start_sglang(extra_args=["--base-gpu-id", "1"])
    trainer = Trainer(ModelConfig(path=proc.cfg.model_path), TrainerConfig(bf16=True), seed=3)
    endpoint = TransferEndpoint()
    core = CoreServer(trainer, endpoint)
    publisher = WeightPublisher(core, "distributed", trainer.model_cfg, "", "127.0.0.1")
    try:
        reply = _in_session(proc.url, publisher.publish())
        embed = _run(
            lambda c: c.post("/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 4}),
            proc.url,
        )
    finally:
        publisher.close()
        core.close()
        endpoint.close()
        proc.stop()
    assert reply["success"]
    want = trainer.engine_weights()["embed_tokens.weight"][:4].float()
    got = torch.tensor(embed, dtype=torch.float32).reshape(want.shape[0], -1)[:, : want.shape[1]]
    assert torch.allclose(got, want.to(got.dtype), atol=1e-2)
