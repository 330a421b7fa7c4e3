"""The core's weight sender (gyre.train.publish.WeightSender) against an engine that takes its update
late, as SGLang does when its update waits for the model-update write lock: the broadcast waits on
the sender's own threads (on GPUs, on a stream of its own), so the trainer trains a step meanwhile,
and the send is answered once the engine has received every tensor, the version's exactly."""

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest
import torch
from _train_ref import as_samples

from gyre.models.config import ModelConfig
from gyre.models.hf import hf_name
from gyre.train.config import TrainerConfig
from gyre.train.elastic import CoreServer
from gyre.train.publish import WeightPublisher
from gyre.train.trainer import Trainer
from gyre.trajectory.pack import pack
from gyre.transfer import TransferEndpoint

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=300,
    max_seq_len=128,
)


@pytest.fixture
def late_engine():
    """tests/unit/_late_engine.py in a process of its own: its URL."""
    script = Path(__file__).with_name("_late_engine.py")
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.kill()
        proc.wait()


def _train_one_step(core: CoreServer) -> None:
    seq = {"prompt": [3, 1, 4, 1], "output": [5, 9, 2, 6], "logprobs": [-1.0] * 4, "advantage": 1.0}
    core.begin_step()
    core.add_micro_batch(pack(as_samples([seq])))
    step = threading.Thread(target=core.run_step)
    step.start()
    core.end_step()
    step.join(timeout=60)
    assert not step.is_alive(), "the training step did not end"


async def _until_asked(session: aiohttp.ClientSession, url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await (await session.get(url + "/asked")).json():
        assert time.monotonic() < deadline, "the sender never asked the engine to update"
        await asyncio.sleep(0.05)


def test_a_broadcast_the_engine_takes_late_leaves_the_trainer_training(late_engine):
    torch.set_num_threads(1)
    trainer = Trainer(MODEL, TrainerConfig(lr=1e-2), seed=3)
    endpoint = TransferEndpoint()
    core = CoreServer(trainer, endpoint)
    publisher = WeightPublisher(core, "distributed", MODEL, "", "127.0.0.1")

    async def go():
        published = publisher.publish()
        sums = {hf_name(n): float(t.double().sum()) for n, t in core.published_tensors(published.version).items()}
        async with aiohttp.ClientSession() as session:
            body = {"engine_url": late_engine, "version": published.version}
            send = asyncio.create_task(session.post(published.source["sender"] + "/send", json=body))
            await _until_asked(session, late_engine)  # the sender broadcasts; the engine has not taken it
            t0 = time.monotonic()
            await asyncio.to_thread(_train_one_step, core)  # the trainer's thread, meanwhile
            trained_s, pending = time.monotonic() - t0, not send.done()
            await session.post(late_engine + "/go")
            async with await send as r:
                return sums, trained_s, pending, r.status, await r.json()

    try:
        sums, trained_s, pending, status, reply = asyncio.run(go())
    finally:
        publisher.close()
        core.close()
        endpoint.close()
    assert pending and trainer.step == 1 and trained_s < 30  # the step ended while the broadcast waited
    assert status == 200 and reply["success"] and reply["message"] == "Weight version updated to 0."
    assert reply["sums"] == sums  # every tensor of the published version, as published
