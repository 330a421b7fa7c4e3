"""Real SGLang (`gpu`): `sglang.launch_server` as Gyre starts it (SGLangProcess) on a tiny Qwen3 with
random weights (`--load-format dummy` of a config Gyre writes), driven through the switch verbs the
cells use: a generate, a paused weight update from a Gyre trainer over NCCL while a call is in
flight, release and resume, and a hand-off between two servers through HiCache's Mooncake store.

Skipped, with the reason, where CUDA, sglang (the `gpu` extra: pyproject.toml), two GPUs (NCCL
refuses two ranks of one communicator on one device) or `mooncake_master` are missing. What the
contract fake models of each behaviour is tested on CPU (test_sglang_behaviour.py, test_sglang_handoff.py).
"""

import asyncio
import shutil
import subprocess

import pytest
import torch

from gyre.common.ports import PortReservation
from gyre.engines.client import EngineClient
from gyre.engines.config import EngineConfig
from gyre.engines.launch import SGLangProcess
from gyre.models.checkpoint import save_checkpoint
from gyre.models.config import ModelConfig
from gyre.models.transformer import init_weights

pytestmark = pytest.mark.gpu
QWEN3 = ModelConfig(
    name="qwen3-tiny",
    num_layers=2,
    hidden_size=256,
    ffn_hidden_size=512,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=1024,
    max_seq_len=2048,
    qk_norm=True,  # qwen3's q/k norms: config.json says Qwen3ForCausalLM (gyre.models.hf)
)
PAGE = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("sglang", reason="needs sglang (pip install '.[gpu]': the pinned set, CUDA 13)")
    path = tmp_path_factory.mktemp("qwen3")
    save_checkpoint(path, QWEN3, init_weights(QWEN3, 0))
    return path


def _engine(model_dir, base_gpu_id: int = 0, **overrides) -> SGLangProcess:
    """A started server on `base_gpu_id`: bf16, token ids in and out (no tokenizer), pages of PAGE."""
    cfg = EngineConfig(
        **{
            "backend": "sglang",
            "model_path": str(model_dir),
            "load_format": "dummy",
            "enable_hicache": False,
            "mem_fraction_static": 0.2,
            "page_size": PAGE,
            "weight_sync": "distributed",
            "startup_timeout_s": 600,
            "extra_args": ["--skip-tokenizer-init", "--dtype", "bfloat16", "--disable-cuda-graph"],
        }
        | overrides
    )
    proc = SGLangProcess(cfg, base_gpu_id)
    proc.start()
    return proc


def _prompt(seed: int, n: int = 3 * PAGE) -> list[int]:
    return torch.randint(10, QWEN3.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _call(client: EngineClient, prompt: list[int], n: int = 8, version: str = "0"):
    return client.generate(prompt, {"max_new_tokens": n, "temperature": 0.0}, extra_key=version)


def test_generate_then_a_paused_update_over_nccl_then_release_and_resume(model_dir):
    """The trainer (GPU 0) publishes by update_weights_from_distributed into the server (GPU 1)
    while a long call runs: SGLangProcess.load pauses (retract), so the update does not wait for
    the call and the call ends normally afterwards; the served embedding is then the trainer's,
    before and after a release/resume round trip (which drops the weights: they are loaded again)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: NCCL refuses the trainer and SGLang as ranks of one device")
    from gyre.train.config import TrainerConfig
    from gyre.train.elastic import CoreServer
    from gyre.train.publish import WeightPublisher
    from gyre.train.trainer import Trainer
    from gyre.transfer import TransferEndpoint

    proc = _engine(model_dir, base_gpu_id=1)
    trainer = Trainer(ModelConfig(path=str(model_dir)), TrainerConfig(bf16=True), seed=3)
    endpoint = TransferEndpoint()
    core = CoreServer(trainer, endpoint)
    publisher = WeightPublisher(core, "distributed", trainer.model_cfg, "", "127.0.0.1")

    async def run() -> dict:
        async with proc.client(timeout_s=300) as c:
            first = await _call(c, _prompt(1))
            long_call = asyncio.create_task(_call(c, _prompt(2), n=512))
            await _until_running(c)  # in flight: the update must not wait for it
            await proc.load(c, publisher.publish())
            loaded = await _embedding(c)
            await proc.release(c)
            await proc.resume(c)
            await proc.load(c, publisher.publish())
            return {"first": first, "long": await long_call, "loaded": loaded, "reloaded": await _embedding(c)}

    try:
        out = asyncio.run(run())
    finally:
        publisher.close()
        core.close()
        endpoint.close()
        proc.stop()
    assert len(out["first"]["output_ids"]) == 8 and out["first"]["meta_info"]["weight_version"] == "0"
    assert out["long"]["meta_info"]["finish_reason"]["type"] in ("length", "stop")  # retracted, not aborted
    want = trainer.engine_weights()["embed_tokens.weight"][:4].float().cpu()
    for got in (out["loaded"], out["reloaded"]):
        got = torch.tensor(got, dtype=torch.float32).reshape(want.shape[0], -1)[:, : want.shape[1]]
        assert torch.allclose(got, want, atol=1e-2)


async def _until_running(c: EngineClient, timeout_s: float = 60.0) -> None:
    """Until the server runs a call (/v1/loads: SGLang 0.5.21 `srt/entrypoints/v1_loads.py`)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while sum(load["num_running_reqs"] for load in (await c.loads())["loads"]) == 0:
        assert asyncio.get_running_loop().time() < deadline, "the call never ran"
        await asyncio.sleep(0.05)


async def _embedding(c: EngineClient):
    return await c.post("/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 4})


def test_a_hand_off_finds_the_sessions_pages_in_the_mooncake_store(model_dir, tmp_path):
    """Two servers sharing a mooncake_master (HiCache, write_through): pages a call wrote on the
    first are cached tokens of the same prompt's call on the second. Write-through is asynchronous
    and SGLang shows no completion, so the second server is probed with prompts the first served,
    one after another (a probe that missed caches its prompt locally: never probed twice)."""
    master_bin = shutil.which("mooncake_master")
    if master_bin is None:
        pytest.skip("needs mooncake_master (the Mooncake wheel of the gpu extra)")
    reservation = PortReservation()  # the master binds it by number; held as long as it runs
    port = reservation.port
    master = subprocess.Popen([master_bin, f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    store = {"enable_hicache": True, "mooncake_master": f"127.0.0.1:{port}", "mooncake_protocol": "tcp"}
    engines = []
    try:
        engines += [_engine(model_dir, **store), _engine(model_dir, **store)]
        cached = asyncio.run(_hand_off(*engines))
    finally:
        for proc in engines:
            proc.stop()
        master.terminate()
        master.wait(timeout=30)
        reservation.close()
    assert cached >= PAGE, "no page of the session came from the store"


async def _hand_off(leaving: SGLangProcess, receiving: SGLangProcess, probes: int = 20) -> int:
    """The cached tokens of the first probe on `receiving` that found pages (0: none did)."""
    async with leaving.client(timeout_s=120) as a, receiving.client(timeout_s=120) as b:
        for seed in range(probes):
            await _call(a, _prompt(100 + seed), n=1)
        for seed in range(probes):
            reply = await _call(b, _prompt(100 + seed), n=1)
            if reply["meta_info"]["cached_tokens"] > 0:
                return reply["meta_info"]["cached_tokens"]
            await asyncio.sleep(0.5)  # the next probe is a prompt not yet asked of `receiving`
    return 0
