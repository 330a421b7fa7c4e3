"""The trainer against the real builtin engine (a separate process): the engine's behaviour
log-probs equal the trainer's recomputation under the same weights, before and after a step whose
weights reach the engine over Mooncake; and the trainer's updates raise the engine's reward."""

import asyncio
import threading

import pytest
import torch
from _train_ref import as_samples

from gyre.engines.client import EngineClient
from gyre.engines.config import EngineConfig
from gyre.engines.launch import BuiltinEngineProcess
from gyre.engines.published import PublishedWeights
from gyre.engines.weights import load_weights, load_weights_at
from gyre.models.config import ModelConfig
from gyre.models.transformer import init_weights
from gyre.train.config import TrainerConfig
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
    vocab_size=32,
    max_seq_len=128,
)
SEED = 0


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    proc = BuiltinEngineProcess(EngineConfig(init_seed=SEED, startup_timeout_s=120), MODEL)
    proc.start()
    endpoint = TransferEndpoint()
    try:
        yield proc.url, endpoint
    finally:
        endpoint.close()
        proc.stop()


def _trainer(lr: float) -> Trainer:
    tr = Trainer(MODEL, TrainerConfig(lr=lr), seed=1)
    tr.load_engine_weights(init_weights(MODEL, SEED))  # the engine's initial weights, engine names
    return tr


async def _rollouts(url, endpoint, trainer, prompts, n_each, new_tokens, seed0):
    """Load the trainer's weights into the engine (Mooncake), then sample `n_each` completions per prompt."""
    descriptor, buffer = endpoint.publish_tensors(trainer.engine_weights())
    async with EngineClient(url, timeout_s=120) as client:
        await load_weights(client, PublishedWeights(trainer.step, "mooncake", descriptor))
        endpoint.unregister(buffer)
        jobs = [
            client.generate(
                p, {"max_new_tokens": new_tokens, "temperature": 1.0, "sampling_seed": seed0 + k * 1000 + j}
            )
            for k, p in enumerate(prompts)
            for j in range(n_each)
        ]
        outs = await asyncio.gather(*jobs)
    for o in outs:
        assert o["meta_info"]["weight_version"] == trainer.step
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def _max_gap(trainer, prompts, n_each, samples):
    seqs = [
        {"prompt": prompts[i // n_each], "output": out, "logprobs": lps, "advantage": 1.0}
        for i, (out, lps) in enumerate(samples)
    ]
    batch = pack(as_samples(seqs))
    return float((trainer.logprobs(batch) - batch.behaviour_logprobs)[batch.target_mask].abs().max()), batch


def test_engine_logprobs_equal_the_trainers_before_and_after_a_step(engine):
    url, endpoint = engine
    tr = _trainer(lr=1e-2)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4], [30]]
    samples = asyncio.run(_rollouts(url, endpoint, tr, prompts, 2, 12, seed0=1))
    gap, batch = _max_gap(tr, prompts, 2, samples)
    assert gap <= 1e-4, f"engine vs trainer log-prob gap {gap} at version 0"
    metrics = tr.train_step([batch])
    assert metrics["logprob_gap_max"] <= 1e-4
    samples = asyncio.run(_rollouts(url, endpoint, tr, prompts, 2, 12, seed0=2))  # version 1, via Mooncake
    gap, _ = _max_gap(tr, prompts, 2, samples)
    assert gap <= 1e-4, f"engine vs trainer log-prob gap {gap} at version 1"


def test_updates_raise_the_engines_mean_reward(engine):
    """Reward = fraction of generated tokens in a target set (1/8 of the vocabulary)."""
    url, endpoint = engine
    tr = _trainer(lr=3e-2)
    target = set(range(4))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    rewards = []
    for step in range(8):
        samples = asyncio.run(_rollouts(url, endpoint, tr, prompts, 4, 8, seed0=100 * step))
        seqs = []
        for k, prompt in enumerate(prompts):
            group = samples[4 * k : 4 * k + 4]
            r = torch.tensor([sum(t in target for t in out) / len(out) for out, _ in group])
            for (out, lps), adv in zip(group, (r - r.mean()).tolist()):
                seqs.append({"prompt": prompt, "output": out, "logprobs": lps, "advantage": adv})
        rewards.append(sum(sum(t in target for t in out) / len(out) for out, _ in samples) / len(samples))
        tr.train_step([pack(as_samples(seqs[:6])), pack(as_samples(seqs[6:]))])
    assert rewards[-1] > rewards[0] + 0.3 and rewards[-1] > 0.5, rewards


def test_weights_reach_the_engine_through_a_model_directory(engine, tmp_path):
    """engine.weight_sync=disk: the core writes the published version as an HF directory and the
    engine loads it by SGLang's /update_weights_from_disk (here on the builtin engine)."""
    from gyre.train.elastic import CoreServer

    url, endpoint = engine
    tr = _trainer(lr=1e-2)
    prompt = [3, 1, 4, 1, 5]
    tr.train_step(
        [pack(as_samples([{"prompt": prompt, "output": [9, 2, 6], "logprobs": [-3.0, -3.0, -3.0], "advantage": 1.0}]))]
    )
    core = CoreServer(tr, endpoint)
    try:
        weights = WeightPublisher(core, "disk", MODEL, str(tmp_path), "127.0.0.1").publish()
        asyncio.run(load_weights_at(url, weights))
        out = asyncio.run(_generate(url, prompt))
    finally:
        core.close()
    assert weights.version == 1 and weights.source["path"] == str(tmp_path / "version_00000001")
    assert out["meta_info"]["weight_version"] == 1
    gap, _ = _max_gap(tr, [prompt], 1, [_sample(out)])
    assert gap <= 1e-4


def test_an_engine_loads_the_weights_the_core_published_while_a_step_runs(engine):
    """The live path (gyre.cells.leader), engine.weight_sync=mooncake: the core publishes while
    run_step computes the open step and the engine loads them with load_weights: version 0, whole.
    After the step, version 1; and version 0, handed out before it, still loads whole."""
    from gyre.train.elastic import CoreServer

    url, endpoint = engine
    tr = _trainer(lr=1e-2)
    before = _trainer(lr=1e-2)  # the same weights, never stepped
    prompts = [[1, 2, 3], [9, 8, 7, 6]]
    samples = asyncio.run(_rollouts(url, endpoint, tr, prompts, 2, 8, seed0=3))
    _, batch = _max_gap(tr, prompts, 2, samples)
    core = CoreServer(tr, endpoint)
    publisher = WeightPublisher(core, "mooncake", MODEL, "", "127.0.0.1")

    def load_and_generate(weights):
        asyncio.run(load_weights_at(url, weights))
        return asyncio.run(_generate(url, prompts[0]))

    try:
        core.begin_step()
        core.add_micro_batch(batch)
        step = threading.Thread(target=core.run_step)
        step.start()
        old = publisher.publish()  # races the step; must be version 0 whole
        gen = load_and_generate(old)
        core.end_step()
        step.join(timeout=120)
        assert gen["meta_info"]["weight_version"] == 0 == old.version
        assert _max_gap(before, [prompts[0]], 1, [_sample(gen)])[0] <= 1e-4
        gen = load_and_generate(publisher.publish())
        assert gen["meta_info"]["weight_version"] == 1 == tr.step
        assert _max_gap(tr, [prompts[0]], 1, [_sample(gen)])[0] <= 1e-4
        gen = load_and_generate(old)
        assert gen["meta_info"]["weight_version"] == 0
        assert _max_gap(before, [prompts[0]], 1, [_sample(gen)])[0] <= 1e-4
    finally:
        core.close()


async def _generate(url, prompt):
    async with EngineClient(url, timeout_s=120) as client:
        return await client.generate(prompt, {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 7})


def _sample(out):
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
