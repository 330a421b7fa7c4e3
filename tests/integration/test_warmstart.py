"""The warm start writes an engine model directory, cached by content hash (a tiny run: two steps)."""

import dataclasses
import json
from pathlib import Path

import torch

import gyre.tasks
from gyre.launch.warmstart import WarmStartConfig, main, reference_transcript, warm_start
from gyre.models.checkpoint import load_checkpoint
from gyre.models.config import ModelConfig
from gyre.models.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer
from gyre.tasks.taskset import TaskSet, toy_taskset


def test_warm_start_writes_engine_weights_and_reuses_them(tmp_path):
    one = TaskSet(toy_taskset().tasks[:1])
    cfg = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2, num_query_groups=1)
    ws = WarmStartConfig(steps=2, batch_size=2, max_tokens=8)
    out, report = warm_start(tmp_path, one, cfg, ws, samples_per_task=1)
    # 7 reference calls (survey ls + report, main write + read back + done, verify ls + report) and
    # the giving-up demonstration
    assert not report["reused"] and report["num_examples"] == 8 and report["loss_last"] < report["loss_first"]
    bpe, byte = load_tokenizer(out, cfg.vocab_size), ByteTokenizer(cfg.vocab_size)
    assert isinstance(bpe, BPETokenizer)  # the vocabulary travels with the weights; prompts are much shorter
    assert len(reference_transcript(bpe, one.tasks[0])[2][0]) * 2 < len(reference_transcript(byte, one.tasks[0])[2][0])
    loaded_cfg, weights = load_checkpoint(out)
    shape = lambda c: {k: v for k, v in dataclasses.asdict(c).items() if k not in ("name", "path")}  # noqa: E731
    assert shape(loaded_cfg) == shape(cfg) and all(torch.isfinite(t).all() for t in weights.values())
    again, report2 = warm_start(tmp_path, one, cfg, ws, samples_per_task=1)
    assert again == out and report2["reused"] and report2["after"] == report["after"]
    other, _ = warm_start(
        tmp_path, one, cfg, WarmStartConfig(steps=2, batch_size=2, max_tokens=8, lr=1e-3), samples_per_task=1
    )
    assert other != out
    byte_ws = dataclasses.replace(ws, quitters=False, tokenizer="byte")
    plain, report3 = warm_start(tmp_path, one, cfg, byte_ws, samples_per_task=1)
    assert plain not in (out, other) and report3["num_examples"] == 7 and not (plain / "bpe.json").exists()


def test_the_command_line_warms_the_model_gyre_train_would(tmp_path, capsys):
    """Its model comes from the composed gyre-train config (conf/model/tiny.yaml and overrides), not
    from ModelConfig's bare defaults (whose vocabulary of 512 is not the tiny model's 1,024)."""
    small = ["model.num_layers=1", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=2"]
    main(["--out", str(tmp_path), "--steps", "2", "--taskset", str(_one_task(tmp_path)), *small])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cfg, _ = load_checkpoint(report["model_dir"])
    assert (cfg.vocab_size, cfg.num_layers, cfg.hidden_size) == (1024, 1, 32)


def _one_task(tmp_path):
    """The toy set's first task, as a task file of its own."""
    path = tmp_path / "one.jsonl"
    path.write_text((Path(gyre.tasks.__file__).parent / "toy" / "tasks.jsonl").read_text().splitlines()[0] + "\n")
    return path
