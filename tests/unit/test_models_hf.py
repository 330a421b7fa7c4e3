"""Hugging Face checkpoints: a tiny random Qwen3 built with `transformers` loads into the trainer
(megatron-core, TP 1 and 2) and the builtin engine with transformers' log-probs, exports back
bitwise, refuses architectures Gyre would compute wrongly, and renders chats with its own template."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _hf_ref import DEFAULT_SYSTEM_TEMPLATE, hf_logprobs, make_qwen3_dir, train_tokenizer
from _train_ref import as_samples, two_rank_env
from safetensors.torch import load_file

from gyre.errors import ConfigError
from gyre.models.checkpoint import load_checkpoint
from gyre.models.config import ModelConfig
from gyre.models.hf import hf_config_fields
from gyre.models.tokenizer import HFTokenizer
from gyre.models.transformer import sequence_logprobs
from gyre.proxy.anthropic import AnthropicWire
from gyre.proxy.calls import CallRunner
from gyre.proxy.config import ProxyConfig
from gyre.proxy.executions import ExecutionRegistry
from gyre.proxy.render import Renderer, TurnMemory, assistant_key
from gyre.train.checkpoint import CheckpointManager
from gyre.train.config import TrainerConfig
from gyre.train.export import export
from gyre.train.trainer import Trainer
from gyre.trajectory.pack import pack

ROOT = Path(__file__).resolve().parents[2]
IDS = torch.randint(0, 397, (48,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    return make_qwen3_dir(tmp_path_factory.mktemp("qwen3") / "m")


def _trainer_logprobs(trainer: Trainer, ids: list[int]) -> torch.Tensor:
    batch = pack(
        as_samples([{"prompt": ids[:4], "output": ids[4:], "logprobs": [0.0] * (len(ids) - 4), "advantage": 1.0}])
    )
    return trainer.logprobs(batch)[1:]


@pytest.mark.parametrize("tie", [pytest.param(False, id="untied"), pytest.param(True, id="tied")])
def test_trainer_and_engine_logprobs_equal_transformers(qwen3, tmp_path, tie):
    qwen3 = make_qwen3_dir(tmp_path / "tied", tie=True, seed=1) if tie else qwen3
    ref = hf_logprobs(qwen3, IDS)
    cfg, weights = load_checkpoint(qwen3)
    assert cfg.qk_norm and cfg.head_dim == 32 and cfg.rotary_base == 1e6  # head_dim != hidden / heads here
    assert (sequence_logprobs(cfg, weights, IDS) - ref).abs().max() <= 1e-4
    trainer = Trainer(ModelConfig(path=str(qwen3)), TrainerConfig())
    assert (_trainer_logprobs(trainer, IDS) - ref).abs().max() <= 1e-4


def test_export_round_trips_bitwise_and_transformers_loads_it(tmp_path):
    src = make_qwen3_dir(tmp_path / "src", dtype=torch.bfloat16, seed=3)
    trainer = Trainer(ModelConfig(path=str(src)), TrainerConfig())
    ckpt = CheckpointManager(tmp_path / "ckpt", keep_last=1).save(trainer)
    out = export(ckpt, tmp_path / "out", src)
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype == torch.bfloat16 and torch.equal(a[n], b[n]) for n in a
    )
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert (hf_logprobs(out, IDS) - hf_logprobs(src, IDS)).abs().max() == 0
    assert HFTokenizer(out).apply_chat_template([{"role": "user", "content": "hi"}]) == HFTokenizer(
        src
    ).apply_chat_template([{"role": "user", "content": "hi"}])


_TP_RANK = """
import sys, torch
from test_models_hf import IDS, _trainer_logprobs
from gyre.common.serve import exit_at_once
from gyre.models.config import ModelConfig
from gyre.train.config import TrainerConfig
from gyre.train.trainer import Trainer
torch.set_num_threads(1)
tr = Trainer(ModelConfig(path=sys.argv[1]), TrainerConfig(tensor_parallel_size=2))
lp, engine = _trainer_logprobs(tr, IDS), tr.engine_weights()
if torch.distributed.get_rank() == 0:
    torch.save({"logprobs": lp, "engine": engine}, sys.argv[2])
torch.distributed.destroy_process_group()
exit_at_once(0)  # as a rank ends in gyre.train.ranks: no teardown of torch's native threads
"""


def test_tp2_loading_matches_tp1(tmp_path, reserve_port):
    src = make_qwen3_dir(tmp_path / "m", seed=5)
    env = two_rank_env(reserve_port())
    logs = [open(tmp_path / f"rank{r}.log", "w") for r in range(2)]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _TP_RANK, str(src), str(tmp_path / "out.pt")],
            cwd=ROOT,
            env=env | {"RANK": str(r)},
            stdout=logs[r],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for r in range(2)
    ]
    one = Trainer(ModelConfig(path=str(src)), TrainerConfig())
    lp, engine = _trainer_logprobs(one, IDS), one.engine_weights()
    try:
        codes = [p.wait(timeout=240) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert (got["logprobs"] - lp).abs().max() <= 1e-5
    assert got["engine"].keys() == engine.keys() and all(torch.equal(got["engine"][n], engine[n]) for n in engine)


BASE = {
    "model_type": "qwen3",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
}


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "mistral"}, "model_type"),
        ({"model_type": "qwen3_moe", "num_experts": 8}, "model_type"),
        ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_parameters.rope_type"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ],
)
def test_unsupported_architectures_fail_at_load_naming_the_field(change, field, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE | change))
    with pytest.raises(ConfigError, match=f"field '{field}'") as e:
        ModelConfig(path=str(tmp_path))  # what `model=hf model.path=DIR`, the trainer and the engine load through
    assert e.value.key == "path"
    assert hf_config_fields(BASE)["qk_norm"] and hf_config_fields(BASE | {"model_type": "llama"})["qk_norm"] is False


def test_sglang_launch_serves_the_model_groups_directory(qwen3):
    import hydra
    from omegaconf import OmegaConf

    from gyre.common import CONF_DIR
    from gyre.config import register_configs
    from gyre.engines.launch import make_sglang_command

    register_configs()
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        composed = hydra.compose(
            config_name="config",
            overrides=["engine=sglang", "model=hf", f"model.path={qwen3}", "engine.mooncake_master=10.0.0.1:50051"],
        )
    # Each group on its own: a whole run refuses engine=sglang where sglang is not installed.
    model, engine = OmegaConf.to_object(composed.model), OmegaConf.to_object(composed.engine)
    assert model.qk_norm and model.num_layers == 2
    cmd = make_sglang_command(engine, 30000, python="python")
    assert cmd[:5] == ["python", "-m", "sglang.launch_server", "--model-path", str(qwen3)]


def test_model_path_without_config_fails_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found") as e:
        ModelConfig(path=str(tmp_path))
    assert e.value.key == "path"


@pytest.mark.parametrize(
    "default_system", [pytest.param(False, id="qwen3"), pytest.param(True, id="default-system-prompt")]
)
def test_renderer_reuses_output_ids_and_renders_the_rest_as_transformers_does(qwen3, tmp_path, default_system):
    """Qwen3's template with a system turn, and Qwen2.5's quirk (a default system prompt injected
    into a conversation without one) with none: fresh parts equal transformers' rendering."""
    if default_system:
        hf = train_tokenizer()
        hf.chat_template = DEFAULT_SYSTEM_TEMPLATE
        hf.save_pretrained(tmp_path)
    tok = HFTokenizer(tmp_path if default_system else qwen3)
    renderer, memory = Renderer(tok), TurnMemory()
    assert renderer.separable and renderer.anchored == default_system
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read",
                "description": "Read a file",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
    ]
    msgs = [{"role": "system", "content": "You are a coding agent."}][default_system:] + [
        {"role": "user", "content": "Fix the bug in main.py"}
    ]
    first = renderer.render(msgs, tools, memory)
    assert ("You are a helpful assistant." in tok.decode(first.input_ids)) == default_system
    assert first.input_ids.tolist() == tok.apply_chat_template(msgs, tools, True)
    # The model thinks, then calls a tool; its ids are kept verbatim (the template would drop the thinking).
    call = tok.apply_chat_template(
        [{"role": "assistant", "content": "", "tool_calls": [{"name": "read", "arguments": {"path": "main.py"}}]}],
        None,
        False,
    )
    out = (
        tok.encode("<think>\nLook at the file first.\n</think>\n\nReading it.")
        + call[call.index(tok.encode("<tool_call>")[0]) - 1 : -1]
    )
    parsed = tok.parse_assistant(out)
    assert (
        parsed.reasoning == "Look at the file first."
        and parsed.content == "Reading it."
        and parsed.tool_calls[0].arguments == {"path": "main.py"}
    )
    calls = [{"name": c.name, "arguments": c.arguments} for c in parsed.tool_calls]
    memory.remember(assistant_key(parsed.content, calls), out)
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": parsed.content, "tool_calls": calls},
        {"role": "tool", "content": "print(1/0)"},
        {"role": "tool", "content": "exit 1"},
    ]
    second = renderer.render(msgs2, tools, memory)
    assert (second.num_reused, second.num_retokenized) == (1, 0)
    n = len(first.input_ids)
    assert (
        second.input_ids[:n].tolist() == first.input_ids.tolist() and second.input_ids[n : n + len(out)].tolist() == out
    )
    assert tok.decode(out[-1:]) == "<|im_end|>"  # the model stopped on it; it is part of its ids
    fresh = second.input_ids[n + len(out) :].tolist()  # separator, the joined tool results, the generation prompt
    full = tok.apply_chat_template(msgs2, tools, True)
    assert full[-len(fresh) :] == fresh and tok.decode(fresh).count("<tool_response>") == 2
    assert tok.decode(fresh).startswith("\n<|im_start|>user\n<tool_response>\nprint(1/0)")


class CountingHFTokenizer(HFTokenizer):
    """Counts the message characters the checkpoint's template is asked to render and tokenize."""

    num_chars = 0

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True):
        self.num_chars += sum(len(m.get("content") or "") for m in messages)
        return super().apply_chat_template(messages, tools, add_generation_prompt)


def test_hf_conversation_call_tokenizes_only_its_new_messages(tmp_path):
    """Through the proxy's call path with a real BPE and a Qwen2.5-style template (a default system
    prompt, so runs render after the anchor): each call of a growing conversation tokenizes its new
    user message and the anchor, never the history, and its prompt equals a from-scratch rendering."""
    hf = train_tokenizer()
    hf.chat_template = DEFAULT_SYSTEM_TEMPLATE
    hf.save_pretrained(tmp_path / "tok")
    tok = CountingHFTokenizer(tmp_path / "tok")
    runner = CallRunner(ProxyConfig(records_dir=str(tmp_path / "r")), tok, Renderer(tok), pool=None)
    ex, wire = ExecutionRegistry(str(tmp_path / "r"), fsync=False).create("e1"), AnthropicWire(["gyre"], 16)
    assert runner.renderer.anchored
    tools = [{"name": "read", "description": "Read a file", "input_schema": {"type": "object"}}]
    body = {
        "model": "gyre",
        "max_tokens": 16,
        "system": "You are a coding agent.",
        "tools": tools,
        "messages": [{"role": "user", "content": "Fix the bug in main.py"}],
    }
    runner.render(ex, wire, body, {})  # the first call renders the head and the first message
    for n in range(1, 5):
        answer = f"Step {n}: reading it."
        out = tok.encode(answer) + [tok.eos_token_id]
        ex.turns.remember(assistant_key(answer, []), out)
        text = f"output {n} " * 30
        body = copy.deepcopy(body)  # fresh JSON each call, as a harness sends it
        body["messages"] += [{"role": "assistant", "content": answer}, {"role": "user", "content": text}]
        before = tok.num_chars
        chat, hints, rendered, _ = runner.render(ex, wire, body, {})
        assert tok.num_chars - before == len("anchor") + len(text), "earlier messages were tokenized again"
        assert (rendered.num_reused, rendered.num_retokenized, rendered.num_rendered_messages) == (n, 0, 2)
        full = runner.renderer.render(chat.messages, chat.tools, ex.turns, hints.agent_id)  # no snapshot: from scratch
        assert rendered.input_ids.tolist() == full.input_ids.tolist() and b"".join(rendered.input_json) == b"".join(
            full.input_json
        )


def test_hf_check_prints_parity_and_roundtrip(qwen3, capsys):
    from gyre.train.hf_check import main

    main([str(qwen3), "--tokens", "24"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (
        line["trainer_max_abs_diff"] <= 1e-4
        and line["engine_max_abs_diff"] <= 1e-4
        and line["roundtrip_bitwise"] is True
    )


def test_gyres_own_model_family_is_written_as_a_llama_transformers_runs(tmp_path):
    from gyre.models.checkpoint import save_checkpoint
    from gyre.models.transformer import init_weights

    cfg = ModelConfig(num_layers=1, hidden_size=64, ffn_hidden_size=96, vocab_size=512, max_seq_len=128)
    weights = init_weights(cfg, 0)
    save_checkpoint(tmp_path / "tiny", cfg, weights)
    assert json.loads((tmp_path / "tiny" / "config.json").read_text())["model_type"] == "llama"
    ids = IDS[:20]
    assert (hf_logprobs(tmp_path / "tiny", ids) - sequence_logprobs(cfg, weights, ids)).abs().max() <= 1e-4
