"""A scripted policy for tests: the builtin engine emits given text for prompts that match a rule.

Tests use it to make a real harness walk tool-using paths with a tiny random model. Only the
choice of tokens is scripted: the engine still runs every forward pass, and each forced token's
log-prob is the model's own, so proxy, engine and records run their real code paths.

Rules file (JSON): `{"rules": [{"match": <regex>, "emit": <text>}, ...]}`. A rule matches when its
regex is found in the prompt text the model has not answered yet (everything after the last
completed assistant turn, special tokens kept). The first matching rule's `emit` (special tokens
such as `<tool_call>` written literally) plus `<|im_end|>` is forced. A resumed request (its
prompt ends with the generation prompt plus partial output, after a reroute) continues the same
text where the partial output stops, so resumption is seamless.
"""

import re
from dataclasses import dataclass

import torch

from gyre.common import jsonio
from gyre.errors import GyreError
from gyre.models.tokenizer import SPECIAL_TOKENS, ByteTokenizer

_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
_GEN_PROMPT = "<|im_start|>assistant\n"


@dataclass(frozen=True)
class ScriptRule:
    match: re.Pattern
    emit: str


class ScriptedPolicy:
    """Maps a prompt to the token ids to force, or None (then the engine samples normally)."""

    def __init__(self, rules: list[ScriptRule], tokenizer: ByteTokenizer):
        self.rules, self.tok = rules, tokenizer

    @classmethod
    def from_file(cls, path: str, tokenizer: ByteTokenizer) -> "ScriptedPolicy":
        try:
            raw = jsonio.loads(open(path).read())["rules"]
            rules = [ScriptRule(re.compile(r["match"], re.DOTALL), str(r["emit"])) for r in raw]
        except (OSError, KeyError, TypeError, ValueError, re.error) as e:
            raise GyreError(f"scripted policy {path}: needs {{'rules': [{{'match', 'emit'}}]}} ({e!r})") from e
        return cls(rules, tokenizer)

    def encode(self, text: str) -> list[int]:
        """Text with literal special-token strings -> ids (specials as their own ids)."""
        ids: list[int] = []
        for piece in _SPECIAL_SPLIT.split(text):
            ids += [self.tok.special_ids[piece]] if piece in self.tok.special_ids else self.tok.encode(piece)
        return ids

    def forced_ids(self, input_ids: list[int]) -> list[int] | None:
        """The whole scripted output still to come for this prompt, or None if no rule matches."""
        text = self.tok.decode(input_ids)
        head, sep, partial = text.rpartition(_GEN_PROMPT)
        if not sep or "<|im_end|>" in partial:
            return None
        done = head.rfind(_GEN_PROMPT)
        unanswered = head[head.find("<|im_end|>", done) + 1 :] if done >= 0 else head
        for rule in self.rules:
            if rule.match.search(unanswered):
                full = self.encode(rule.emit) + [self.tok.special_ids["<|im_end|>"]]
                done_ids = self.encode(partial)
                return full[len(done_ids) :] if full[: len(done_ids)] == done_ids else None
        return None


def forced_logprob(logits: torch.Tensor, token: int, temperature: float) -> float:
    """The model's log-prob of `token` (at `temperature`, 1 when greedy), as `sample` reports it."""
    t = temperature if temperature > 0 else 1.0
    return float(torch.log_softmax(logits.float() / t, -1)[token])
