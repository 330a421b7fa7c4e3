"""Tokenizers and the chat template: one interface for Gyre's byte tokenizer and HF tokenizers.

The chat format is ChatML as Qwen2.5 writes it, so prompts and tool calls look the same to the
proxy for the tiny model and for real Qwen models:

    <|im_start|>system\n{system}\n\n# Tools ...<tools>\n{json per tool}\n</tools>...<|im_end|>\n
    <|im_start|>user\n{text}<|im_end|>\n
    <|im_start|>assistant\n{text}<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n
    <|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n   (role "tool")
    <|im_start|>assistant\n                                                    (generation prompt)

Messages are OpenAI-style dicts: {"role", "content", "tool_calls": [{"name", "arguments"}]}.
`ByteTokenizer` needs no files: bytes are ids 0..255 and the special tokens follow. Special-token
text inside message content is encoded as plain bytes, so content cannot forge structure.
`BPETokenizer` is the same with a byte-level BPE vocabulary (trained with `tokenizers` by
`train_bpe`, stored as `bpe.json` in the model directory) in place of the 256 bytes: the tiny
model's prompts are ~4x shorter, and the special tokens follow its vocabulary the same way.
`HFTokenizer` renders with the checkpoint's own template through `transformers` (jinja2), exactly
as `transformers`, SGLang and vLLM do, including their parsing of special-token text in content.
Generated turns are parsed by `gyre.models.parse` (a thinking block, Qwen3's `<think>...</think>`,
goes to `ParsedAssistant.reasoning`, not content).
"""

import os
from abc import ABC, abstractmethod
from pathlib import Path

from gyre.common import jsonio
from gyre.errors import GyreError
from gyre.models.parse import ParsedAssistant, parse_assistant_text

ROLES = ("system", "user", "assistant", "tool")
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
BPE_FILE = "bpe.json"
"""A `BPETokenizer`'s vocabulary inside a model directory (a `tokenizers` JSON file)."""


class ChatTemplateError(GyreError):
    """A message list the template cannot render (unknown role, bad tool call)."""


class Special(str):
    """A piece of a rendered chat that is a special token, not text."""


def validate_messages(messages: list[dict]) -> None:
    """The message rules both tokenizers enforce (templates may silently skip what they don't know).

    Raises:
        ChatTemplateError: naming the message index and the problem.
    """
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ROLES or (role == "system" and i > 0):
            raise ChatTemplateError(
                f"message {i}: role {role!r} not allowed here; valid: user, assistant, tool (system only first)"
            )
        if content is not None and not isinstance(content, str):
            raise ChatTemplateError(f"message {i}: content must be a string, got {type(content).__name__}")
        for call in m.get("tool_calls") or []:
            if (
                not isinstance(call, dict)
                or not isinstance(call.get("name"), str)
                or not isinstance(call.get("arguments", {}), dict)
            ):
                raise ChatTemplateError(f"message {i}: a tool call needs a string 'name' and an object 'arguments'")


def render_chat(messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> list[str]:
    """Render messages into pieces: `Special` tokens and plain text (pure; the tokenizer maps them).

    Raises:
        ChatTemplateError: naming the message index and the problem.
    """
    validate_messages(messages)
    out: list[str] = []
    msgs = list(messages)
    system = msgs.pop(0)["content"] if msgs and msgs[0].get("role") == "system" else None
    if tools:
        lines = "\n".join(jsonio.dumps(t, sort_keys=True, python_text=True) for t in tools)
        system = (system or "You are a helpful assistant.") + (
            "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML "
            f"tags:\n<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
            '"arguments": <args-json-object>}\n</tool_call>'
        )
    if system is not None:
        out += [Special("<|im_start|>"), f"system\n{system}", Special("<|im_end|>"), "\n"]
    for m in msgs:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            out += [
                Special("<|im_start|>"),
                "user\n",
                Special("<tool_response>"),
                f"\n{content}\n",
                Special("</tool_response>"),
                Special("<|im_end|>"),
                "\n",
            ]
            continue
        out += [Special("<|im_start|>"), f"{role}\n{content}"]
        for call in m.get("tool_calls") or []:
            body = jsonio.dumps({"name": call["name"], "arguments": call.get("arguments", {})}, python_text=True)
            out += ["\n" if content else "", Special("<tool_call>"), f"\n{body}\n", Special("</tool_call>")]
        out += [Special("<|im_end|>"), "\n"]
    if add_generation_prompt:
        out += [Special("<|im_start|>"), "assistant\n"]
    return [p for p in out if p]


class BaseTokenizer(ABC):
    """What the proxy and engines need from a tokenizer, for Gyre's byte tokenizer and HF ones alike."""

    vocab_size: int
    eos_token_id: int

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Plain text to ids; special-token strings in `text` are not treated as special."""

    @abstractmethod
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...

    @abstractmethod
    def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> list[int]: ...

    @property
    @abstractmethod
    def stop_token_ids(self) -> list[int]:
        """Ids that end an assistant turn (pass as sampling_params.stop_token_ids)."""

    def parse_assistant(self, output_ids: list[int]) -> ParsedAssistant:
        """Parse generated ids of one assistant turn into content and tool calls."""
        return parse_assistant_text(self.decode(output_ids))


class _GyreVocab(BaseTokenizer):
    """Gyre's own vocabularies: `num_plain` plain ids (bytes or BPE tokens), then SPECIAL_TOKENS; ids
    above those up to vocab_size-1 are reserved (decode to ""). The chat template is Gyre's."""

    num_plain: int

    def _specials(self) -> None:
        self.special_ids = {s: self.num_plain + i for i, s in enumerate(SPECIAL_TOKENS)}
        self._special_by_id = {i: s for s, i in self.special_ids.items()}
        self.eos_token_id = self.special_ids["<|im_end|>"]

    @abstractmethod
    def _decode_plain(self, ids: list[int]) -> str:
        """A run of plain ids to text."""

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.special_ids["<|im_end|>"], self.special_ids["<|endoftext|>"]]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out, run = [], []
        for i in ids:
            if 0 <= i < self.num_plain:
                run.append(i)
                continue
            out.append(self._decode_plain(run) if run else "")
            run = []
            if i in self._special_by_id and not skip_special_tokens:
                out.append(self._special_by_id[i])
        out.append(self._decode_plain(run) if run else "")
        return "".join(out)

    def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        ids: list[int] = []
        for piece in render_chat(messages, tools, add_generation_prompt):
            ids += [self.special_ids[piece]] if isinstance(piece, Special) else self.encode(piece)
        return ids


class ByteTokenizer(_GyreVocab):
    """Bytes 0..255, then SPECIAL_TOKENS; ids above those up to vocab_size-1 are reserved (decode to "")."""

    num_plain = 256

    def __init__(self, vocab_size: int = 512):
        if vocab_size < 256 + len(SPECIAL_TOKENS):
            raise GyreError(f"ByteTokenizer needs vocab_size >= {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
        self.vocab_size = vocab_size
        self._specials()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def _decode_plain(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class BPETokenizer(_GyreVocab):
    """A byte-level BPE vocabulary (ids 0..n-1), then SPECIAL_TOKENS; ids up to vocab_size-1 are reserved.

    Special tokens are not part of the `tokenizers` vocabulary, so their text inside content is
    encoded as plain text, as with `ByteTokenizer`."""

    def __init__(self, path: str | os.PathLike, vocab_size: int | None = None):
        from tokenizers import Tokenizer

        file = Path(path) / BPE_FILE if Path(path).is_dir() else Path(path)
        self._tok = Tokenizer.from_file(str(file))
        n = self._tok.get_vocab_size()
        self.vocab_size = vocab_size or n + len(SPECIAL_TOKENS)
        if self.vocab_size < n + len(SPECIAL_TOKENS):
            raise GyreError(
                f"{file}: {n} BPE tokens and {len(SPECIAL_TOKENS)} special ones need vocab_size >= "
                f"{n + len(SPECIAL_TOKENS)}, got {self.vocab_size}"
            )
        self.num_plain = n
        self._specials()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def _decode_plain(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def train_bpe(texts: list[str], vocab_size: int, out_dir: str | os.PathLike) -> Path:
    """Train a byte-level BPE vocabulary of `vocab_size` ids, special tokens included, on `texts`
    and write it to OUT_DIR/bpe.json (deterministic: the same texts give the same file).

    GPT-2's pre-tokenisation keeps merges inside words, so a word of the texts is one or a few
    tokens and the boundary after a role line (`assistant\n`) stays a token boundary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(out_dir) / BPE_FILE))
    return Path(out_dir) / BPE_FILE


def load_tokenizer(path: str | os.PathLike | None, vocab_size: int) -> BaseTokenizer:
    """The tokenizer of a model directory (its `bpe.json`, else its Hugging Face files), or the
    byte tokenizer of `vocab_size` without one.

    Raises:
        GyreError: a directory with neither, a BPE vocabulary larger than `vocab_size`, or HF files
            without a chat template.
    """
    if path is None:
        return ByteTokenizer(vocab_size)
    if has_bpe_tokenizer(path):
        return BPETokenizer(path, vocab_size)
    return HFTokenizer(path)


def has_bpe_tokenizer(path: str | os.PathLike) -> bool:
    """Whether a model directory carries a `BPETokenizer` vocabulary."""
    return (Path(path) / BPE_FILE).is_file()


def has_hf_tokenizer(path: str | os.PathLike) -> bool:
    """Whether a model directory carries Hugging Face tokenizer files."""
    return any((Path(path) / f).is_file() for f in _HF_TOKENIZER_FILES)


class HFTokenizer(BaseTokenizer):
    """A Hugging Face tokenizer and the chat template from a model directory (real Qwen models).

    Messages are converted to the OpenAI shape HF templates read (`tool_calls` as
    `{"type": "function", "function": {"name", "arguments": {...}}}`, content never None) and
    rendered by `transformers`' own `apply_chat_template`, so the ids are the template's exactly.
    `template_kwargs` go to the template (e.g. `{"enable_thinking": False}` for Qwen3).
    """

    def __init__(self, model_path: str | os.PathLike, template_kwargs: dict | None = None):
        from transformers import AutoTokenizer

        if not has_hf_tokenizer(model_path):
            raise GyreError(f"{model_path} has no tokenizer files ({', '.join(_HF_TOKENIZER_FILES)})")
        self._tok = AutoTokenizer.from_pretrained(str(model_path))
        if not self._tok.chat_template:
            raise GyreError(
                f"{model_path}: the tokenizer has no chat template (tokenizer_config.json or chat_template.jinja)"
            )
        self.template_kwargs = dict(template_kwargs or {})
        self.vocab_size = len(self._tok)
        self.eos_token_id = self._tok.eos_token_id

    @property
    def stop_token_ids(self) -> list[int]:
        ids = {self.eos_token_id}
        for s in ("<|im_end|>", "<|endoftext|>"):
            i = self._tok.convert_tokens_to_ids(s)
            if isinstance(i, int) and i != self._tok.unk_token_id:
                ids.add(i)
        return sorted(i for i in ids if i is not None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False, split_special_tokens=True)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        from jinja2 import TemplateError

        validate_messages(messages)
        hf_msgs = [_hf_message(m) for m in messages]
        try:
            out = self._tok.apply_chat_template(
                hf_msgs,
                tools=tools or None,
                tokenize=True,
                return_dict=False,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"the model's chat template refused the messages: {e}") from None
        return list(out)


def _hf_message(m: dict) -> dict:
    out = {**m, "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}}
            for c in m["tool_calls"]
        ]
    return out
