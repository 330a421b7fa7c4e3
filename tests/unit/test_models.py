"""gyre.models: the weight-name contract, deterministic init, the KV-cached forward vs the reference,
safetensors directories, and the byte tokenizer's chat template and tool-call parsing."""

import json

import pytest
import torch

from gyre.engines.runner import SeqKV, StepItem, run_step
from gyre.errors import GyreError
from gyre.models.checkpoint import load_checkpoint, save_checkpoint
from gyre.models.config import ModelConfig
from gyre.models.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    ChatTemplateError,
    load_tokenizer,
    parse_assistant_text,
    train_bpe,
)
from gyre.models.transformer import init_weights, param_shapes, sequence_logprobs

CFG = ModelConfig()


def test_param_names_follow_the_agreed_contract():
    shapes = param_shapes(CFG)
    assert shapes["embed_tokens.weight"] == (512, 128)
    assert shapes["layers.1.self_attn.q_proj.weight"] == (128, 128)
    assert shapes["layers.1.self_attn.k_proj.weight"] == (64, 128)  # 2 KV heads x 32
    assert shapes["layers.0.self_attn.o_proj.weight"] == (128, 128)
    assert shapes["layers.0.mlp.down_proj.weight"] == (128, 384)
    assert "lm_head.weight" in shapes and not any("bias" in n for n in shapes)
    assert "lm_head.weight" not in param_shapes(ModelConfig(tie_embeddings=True))


def test_init_is_deterministic_per_seed():
    a, b, c = init_weights(CFG, 3), init_weights(CFG, 3), init_weights(CFG, 4)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["embed_tokens.weight"], c["embed_tokens.weight"])


@pytest.mark.parametrize(
    "chunks",
    [
        pytest.param([40], id="one-prefill"),
        pytest.param([17, 16, 7], id="chunked"),
        pytest.param([30] + [1] * 10, id="prefill-then-decode"),
    ],
)
def test_kv_cached_steps_match_the_full_forward(chunks):
    w = init_weights(CFG, 0)
    ids = torch.randint(0, CFG.vocab_size, (sum(chunks) + 1,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = sequence_logprobs(CFG, w, ids)  # ref[j] = log p(ids[j+1] | ids[:j+1])
    other = SeqKV(CFG)  # a second sequence batched alongside must not change anything
    kv, pos, got, want = SeqKV(CFG), 0, [], []
    for n in chunks:
        item, noise = StepItem(kv, ids[pos : pos + n], want_logits=True), StepItem(other, [5, 6], want_logits=True)
        run_step(CFG, w, [noise, item])
        pos += n
        got.append(torch.log_softmax(item.logits, -1)[ids[pos]])
        want.append(ref[pos - 1])
    assert (torch.stack(got) - torch.stack(want)).abs().max() <= 1e-5


def test_checkpoint_round_trips_and_rejects_mismatches(tmp_path):
    w = init_weights(CFG, 0)
    save_checkpoint(tmp_path / "m", CFG, w)
    cfg, w2 = load_checkpoint(tmp_path / "m")
    assert cfg.same_architecture(CFG) and all(torch.equal(w[n], w2[n]) for n in w)
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw | {"num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="missing"):
        load_checkpoint(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path / "nothing")


TOK = ByteTokenizer(512)


def test_chat_template_renders_all_roles_and_tool_calls():
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "bash", "arguments": {"cmd": "ls"}}]},
        {"role": "tool", "content": "a.py"},
    ]
    ids = TOK.apply_chat_template(msgs, tools=[{"name": "bash", "parameters": {}}])
    text = TOK.decode(ids)
    assert text.startswith("<|im_start|>system\nbe brief\n\n# Tools")
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\na.py\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert max(ids) < 512 and TOK.eos_token_id in TOK.stop_token_ids


def test_special_text_in_content_stays_plain_bytes():
    ids = TOK.apply_chat_template([{"role": "user", "content": "<|im_end|>"}], add_generation_prompt=False)
    assert ids.count(TOK.special_ids["<|im_end|>"]) == 1  # only the template's own


BPE_TEXTS = [
    "You are a coding agent. Use the tools to complete the task in the current directory.",
    'Write "apple" to "answer.txt".',
    'Write "river" to "note.txt".',
    '\n{"name": "write_file", "arguments": {"path": "answer.txt", "content": "apple"}}\n',
] * 3


def test_bpe_vocabulary_is_deterministic_and_keeps_the_template_separable(tmp_path):
    """train_bpe gives the same file twice; BPETokenizer round-trips text, keeps special-token
    text in content plain, and the generation prompt is a prefix of the rendered answer."""
    a, b = train_bpe(BPE_TEXTS, 320, tmp_path / "a"), train_bpe(BPE_TEXTS, 320, tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()
    tok = load_tokenizer(tmp_path / "a", 320)
    assert isinstance(tok, BPETokenizer) and tok.vocab_size == 320 and max(tok.special_ids.values()) < 320
    text = 'Write "apple" to "answer.txt". ünïcode <|im_end|>'
    assert tok.decode(tok.encode(text)) == text and len(tok.encode('"apple"')) < len('"apple"')
    msgs = [{"role": "user", "content": "Write <|im_end|> to a.txt"}]
    prompt = tok.apply_chat_template(msgs)
    assert prompt.count(tok.eos_token_id) == 1  # only the template's own
    reply = {"role": "assistant", "content": "Done.", "tool_calls": [{"name": "f", "arguments": {"x": "apple"}}]}
    full = tok.apply_chat_template(msgs + [reply], add_generation_prompt=False)
    assert full[: len(prompt)] == prompt
    parsed = tok.parse_assistant(full[len(prompt) :])
    assert parsed.content == "Done." and parsed.tool_calls[0].arguments == {"x": "apple"}
    with pytest.raises(GyreError, match="vocab_size"):
        BPETokenizer(tmp_path / "a", 300)
    assert isinstance(load_tokenizer(None, 512), ByteTokenizer)


def test_assistant_output_parses_back_into_tool_calls():
    out = (
        TOK.encode("let me look")
        + [TOK.special_ids["<tool_call>"]]
        + TOK.encode('\n{"name": "bash", "arguments": {"cmd": "ls"}}\n')
    )
    out += [TOK.special_ids["</tool_call>"], TOK.eos_token_id]
    parsed = TOK.parse_assistant(out)
    assert (
        parsed.content == "let me look"
        and parsed.tool_calls[0].name == "bash"
        and parsed.tool_calls[0].arguments == {"cmd": "ls"}
    )


@pytest.mark.parametrize(
    "body",
    [
        pytest.param("{not json", id="bad-json"),
        pytest.param('{"arguments": {}}', id="no-name"),
        pytest.param('{"name": "x", "arguments": 3}', id="args-not-object"),
    ],
)
def test_malformed_tool_calls_are_kept_not_dropped(body):
    parsed = parse_assistant_text(f"hi<tool_call>{body}</tool_call>")
    assert parsed.tool_calls == [] and parsed.malformed == [body]


@pytest.mark.parametrize(
    "msgs",
    [
        pytest.param([{"role": "robot", "content": "x"}], id="unknown-role"),
        pytest.param([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], id="late-system"),
        pytest.param([{"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]}], id="nameless-call"),
    ],
)
def test_bad_messages_name_their_index(msgs):
    with pytest.raises(ChatTemplateError, match="message"):
        TOK.apply_chat_template(msgs)


def _materialised_attention(q, k, v, num_cached):
    """The engine's former attention: full score matrix, explicit causal mask, repeated KV heads."""
    t, nh, hd = q.shape
    rep = nh // k.shape[1]
    kh, vh = k.transpose(0, 1).repeat_interleave(rep, 0), v.transpose(0, 1).repeat_interleave(rep, 0)
    scores = q.transpose(0, 1) @ kh.transpose(1, 2) / hd**0.5
    allowed = torch.arange(k.shape[0])[None, :] <= (num_cached + torch.arange(t))[:, None]
    out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vh
    return out.transpose(0, 1).reshape(t, nh * hd)


@pytest.mark.parametrize("t, cached", [(1, 0), (1, 9), (12, 0), (12, 9), (40, 70)])
def test_fused_blockwise_attention_equals_the_materialised_one(monkeypatch, t, cached):
    from gyre.models import transformer

    monkeypatch.setattr(transformer, "ATTENTION_MASK_BYTES", 64 * 4 * 16)  # 16-query blocks at 64+ keys
    g = torch.Generator().manual_seed(t + cached)
    q, k, v = (
        torch.randn(t, 4, 16, generator=g),
        torch.randn(cached + t, 2, 16, generator=g),
        torch.randn(cached + t, 2, 16, generator=g),
    )
    assert (transformer.attend(q, k, v, cached) - _materialised_attention(q, k, v, cached)).abs().max() <= 1e-5


def test_logits_on_short_prompts_equal_the_materialised_attention(monkeypatch):

    w = init_weights(CFG, 0)
    ids = torch.randint(0, CFG.vocab_size, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    kv, item = SeqKV(CFG), None
    for chunk in (ids[:13], ids[13:]):  # the second chunk attends over cached keys
        item = StepItem(kv, chunk, want_logits=True)
        run_step(CFG, w, [item])
    monkeypatch.setattr("gyre.engines.runner.attend", _materialised_attention)
    kv2 = SeqKV(CFG)
    for chunk in (ids[:13], ids[13:]):
        ref = StepItem(kv2, chunk, want_logits=True)
        run_step(CFG, w, [ref])
    assert (item.logits - ref.logits).abs().max() <= 1e-5


def test_the_forward_runs_on_bf16_weights_close_to_fp32():
    """bf16 weights keep q, k and v in bf16 (RoPE tables are cast, as transformers does): the fused
    attention takes them, and the log-probs stay within bf16's tolerance of the fp32 forward (tools/gpu_check.py)."""
    cfg = ModelConfig(qk_norm=True)
    w = init_weights(cfg, 0)
    ids = torch.randint(0, cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    diff = (
        sequence_logprobs(cfg, {n: t.to(torch.bfloat16) for n, t in w.items()}, ids) - sequence_logprobs(cfg, w, ids)
    ).abs()
    assert diff.mean() <= 0.02 and diff.max() <= 0.5
