"""The megatron-core trainer on CPU: converter round trip, bitwise resume from a checkpoint,
crash-safe saving, keep-last-N, bad input."""

import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _train_ref import as_samples, random_batches

from gyre.models.checkpoint import load_checkpoint, save_checkpoint
from gyre.models.config import ModelConfig
from gyre.models.convert import ConversionError, engine_to_megatron, megatron_to_engine
from gyre.train.batch import BatchError
from gyre.train.checkpoint import CheckpointManager, list_checkpoints
from gyre.train.config import TrainerConfig
from gyre.train.trainer import Trainer
from gyre.trajectory.pack import pack

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=64,
    max_seq_len=256,
)
CFG = TrainerConfig(lr=1e-3)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    torch.set_num_threads(1)


def test_converter_round_trips_and_names_the_broken_tensor(tmp_path):
    cfg = replace(MODEL, num_query_groups=1)  # MQA: the group split must still be right
    tr = Trainer(cfg, CFG, seed=1)
    state = {k: v for k, v in tr.model.state_dict().items() if not k.endswith("_extra_state")}
    engine = megatron_to_engine(state, cfg)
    assert engine["layers.0.self_attn.k_proj.weight"].shape == (cfg.head_dim, cfg.hidden_size)
    assert all(torch.equal(state[k], v) for k, v in engine_to_megatron(engine, cfg).items())
    save_checkpoint(tmp_path / "w", cfg, engine)  # the engines' on-disk format
    loaded_cfg, loaded = load_checkpoint(tmp_path / "w")
    assert loaded_cfg.same_architecture(cfg) and all(torch.equal(loaded[k], engine[k]) for k in engine)
    del engine["layers.1.mlp.up_proj.weight"]
    with pytest.raises(ConversionError, match="layers.1.mlp.up_proj.weight"):
        engine_to_megatron(engine, cfg)


def test_two_steps_checkpoint_one_step_equals_resume_one_step_bitwise(tmp_path):
    steps = [random_batches(MODEL, 2, 2, seed=s) for s in range(3)]
    a = Trainer(MODEL, CFG, seed=0)
    a.train_step(steps[0]), a.train_step(steps[1])
    ckpt = CheckpointManager(tmp_path, keep_last=2)
    ckpt.save(a, {"data_cursor": 17})
    a.train_step(steps[2])
    b = Trainer(MODEL, CFG, seed=5)  # different initial weights: everything must come from the checkpoint
    assert ckpt.load_latest(b) == {"data_cursor": 17} and b.step == 2
    b.train_step(steps[2])
    assert torch.equal(a.flat.weights, b.flat.weights)
    for pa, pb in zip(a.flat.params, b.flat.params):
        sa, sb = a.optimizer.state[pa], b.optimizer.state[pb]
        assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"]) and float(sa["step"]) == float(sb["step"]) == 3


def test_keep_last_n(tmp_path):
    tr = Trainer(MODEL, CFG, seed=0)
    ckpt = CheckpointManager(tmp_path, keep_last=2)
    for s in range(3):
        tr.train_step(random_batches(MODEL, 1, 1, seed=s))
        ckpt.save(tr)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]


_CRASH_SCRIPT = """
import os, signal, sys, torch
sys.path.insert(0, "tests/unit")
from _train_ref import random_batches
from test_train_megatron import MODEL, CFG
from gyre.train import checkpoint
from gyre.train.trainer import Trainer

def main():
    tr = Trainer(MODEL, CFG, seed=0)
    ckpt = checkpoint.CheckpointManager(sys.argv[1], keep_last=3)
    tr.train_step(random_batches(MODEL, 1, 2, seed=0))
    ckpt.save(tr, {"cursor": 1})
    torch.save(tr.flat.weights, sys.argv[2])
    tr.train_step(random_batches(MODEL, 1, 2, seed=1))
    # Die the hard way after every byte of step 2 is written, just before it is published.
    checkpoint.publish = lambda tmp, final, fsync: os.kill(os.getpid(), signal.SIGKILL)
    ckpt.save(tr, {"cursor": 2})

if __name__ == "__main__":
    main()
"""


def test_a_crash_while_saving_leaves_the_previous_checkpoint_loadable(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests/unit'}", OMP_NUM_THREADS="1")
    log = tmp_path / "child.log"
    with open(log, "w") as out:  # not a pipe: dist_checkpointing's helper processes would hold it open
        proc = subprocess.Popen(
            [sys.executable, "-c", _CRASH_SCRIPT, str(tmp_path / "ck"), str(tmp_path / "w1.pt")],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert rc == -signal.SIGKILL, log.read_text()[-2000:]
    with pytest.raises(ProcessLookupError):  # the child's session is empty: no checkpoint helper outlived it
        os.killpg(proc.pid, 0)
    assert (tmp_path / "ck" / ".tmp-step_00000002").is_dir()  # the interrupted save
    assert [s for s, _ in list_checkpoints(tmp_path / "ck")] == [1]
    tr = Trainer(MODEL, CFG, seed=3)
    ckpt = CheckpointManager(tmp_path / "ck", keep_last=3)
    assert ckpt.load_latest(tr) == {"cursor": 1}
    assert torch.equal(tr.flat.weights, torch.load(tmp_path / "w1.pt"))
    tr.train_step(random_batches(MODEL, 1, 2, seed=1))
    ckpt.save(tr)  # the next save clears the debris
    assert not list((tmp_path / "ck").glob(".tmp-*"))
    assert [s for s, _ in list_checkpoints(tmp_path / "ck")] == [1, 2]


def test_bad_input_is_rejected_with_a_reason_and_the_rest_trains():
    tr = Trainer(MODEL, CFG, seed=0)
    good = {"prompt": [1, 2], "output": [3, 4, 5], "logprobs": [-1.0, -2.0, -3.0], "advantage": 1.0, "id": "good"}
    empty = {"prompt": [1, 2, 3], "output": [], "logprobs": [], "advantage": 1.0, "id": "empty"}
    batch = pack(as_samples([good, empty]))
    one = pack(as_samples([good]))
    misaligned = replace(one, behaviour_logprobs=torch.roll(one.behaviour_logprobs, 1))
    metrics = tr.train_step([batch, pack(as_samples([good]))])
    assert metrics["excluded/empty_targets"] == 1 and metrics["num_targets"] == 6
    with pytest.raises(BatchError, match="logprobs_misaligned"):
        tr.train_step([misaligned])
    with pytest.raises(BatchError, match="advantages has shape"):
        tr.microstep(replace(batch, advantages=batch.advantages[:3]), 1.0)


def test_entropy_and_kl_terms_when_switched_on():
    tr = Trainer(MODEL, replace(CFG, entropy_coef=0.01, kl_coef=0.1), seed=0)
    metrics = tr.train_step(random_batches(MODEL, 1, 2, seed=8))
    assert 0 < metrics["entropy_mean"] <= float(torch.log(torch.tensor(MODEL.vocab_size))) + 1e-4
    assert metrics["grad_norm"] > 0
