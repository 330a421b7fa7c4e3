"""Two ranks over gloo, tensor-parallel 2 or data-parallel 2: the same log-probs and the same step
as one rank.

The TP=1 checkpoint (model and Adam state) is resharded to TP=2 by dist_checkpointing on load; the
TP=2 ranks step, gather engine-named weights and save; the TP=1 side compares both.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _train_ref import random_batches, two_rank_env

from gyre.models.config import ModelConfig
from gyre.train.checkpoint import CheckpointManager
from gyre.train.config import TrainerConfig
from gyre.train.trainer import Trainer

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

_RANK_SCRIPT = """
import sys, torch
from dataclasses import replace
from _train_ref import random_batches
from test_train_tp import MODEL, CFG
from gyre.train.checkpoint import CheckpointManager
from gyre.train.trainer import Trainer

def main(tp, src, dst, out):
    torch.set_num_threads(1)
    tr = Trainer(MODEL, replace(CFG, tensor_parallel_size=int(tp)), seed=9)
    CheckpointManager(src, keep_last=1).load_latest(tr)
    lp = tr.logprobs(random_batches(MODEL, 1, 3, seed=5)[0])
    metrics = tr.train_step(random_batches(MODEL, 3, 2, seed=6))
    CheckpointManager(dst, keep_last=1).save(tr)
    engine = tr.engine_weights()  # a collective: every rank gathers
    if torch.distributed.get_rank() == 0:
        torch.save({"logprobs": lp, "grad_norm": metrics["grad_norm"], "engine": engine}, out)
    torch.distributed.destroy_process_group()

if __name__ == "__main__":
    main(*sys.argv[1:])
"""


@pytest.mark.parametrize("tp", [pytest.param(2, id="tp2"), pytest.param(1, id="dp2")])
def test_two_ranks_over_gloo_match_one_rank(tmp_path, tp):
    env = two_rank_env()
    one = Trainer(MODEL, CFG, seed=0)
    one.train_step(random_batches(MODEL, 1, 2, seed=4))  # non-zero Adam state to reshard
    CheckpointManager(tmp_path / "tp1", keep_last=1).save(one)
    args = [str(tp), str(tmp_path / "tp1"), str(tmp_path / "tp2"), str(tmp_path / "out.pt")]
    logs = [open(tmp_path / f"rank{r}.log", "w") for r in range(2)]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK_SCRIPT, *args],
            cwd=ROOT,
            env=env | {"RANK": str(r)},
            stdout=logs[r],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for r in range(2)
    ]
    lp = one.logprobs(random_batches(MODEL, 1, 3, seed=5)[0])
    metrics = one.train_step(random_batches(MODEL, 3, 2, seed=6))
    try:
        codes = [p.wait(timeout=240) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert (got["logprobs"] - lp).abs().max() <= 1e-5
    assert abs(got["grad_norm"] - metrics["grad_norm"]) <= 1e-5 * metrics["grad_norm"]
    expected = one.engine_weights()
    for name, t in got["engine"].items():
        assert (t - expected[name]).abs().max() <= 1e-5 * expected[name].abs().max(), name
    back = Trainer(MODEL, CFG, seed=3)
    CheckpointManager(tmp_path / "tp2", keep_last=1).load_latest(back)
    rel = float((back.flat.weights - one.flat.weights).abs().max() / one.flat.weights.abs().max())
    assert back.step == 2 and rel <= 1e-5
