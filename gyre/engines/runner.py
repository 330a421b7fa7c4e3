"""The builtin engine's model runner: per-sequence KV caches, one batched forward step, sampling.

A step takes any mix of prefill chunks and single decode tokens from many sequences, runs the
token-wise work on all of them at once and attention per sequence (no padding), so a sequence's
numbers do not depend on what it was batched with.
"""

from dataclasses import dataclass, field

import torch

from gyre.models.config import ModelConfig
from gyre.models.transformer import attend, forward_tokens, logits_of


class SeqKV:
    """One sequence's KV cache, token-major: [num_layers, 2, capacity, num_kv_heads, head_dim]."""

    def __init__(self, cfg: ModelConfig, capacity: int = 64):
        self._shape = (cfg.num_layers, 2, capacity, cfg.num_query_groups, cfg.head_dim)
        self.data = torch.empty(self._shape)
        self.length = 0

    def reserve(self, n: int) -> None:
        if n > self.data.shape[2]:
            grown = torch.empty(self._shape[:2] + (max(n, 2 * self.data.shape[2]),) + self._shape[3:])
            grown[:, :, : self.length] = self.data[:, :, : self.length]
            self.data = grown

    def load_pages(self, pages: list[torch.Tensor]) -> None:
        """Start the cache from a cached prefix (pieces [L, 2, n, nKV, hd], PrefixCache.match),
        copied once, straight into place."""
        n = sum(p.shape[2] for p in pages)
        self.reserve(n)
        if pages:
            torch.cat(pages, dim=2, out=self.data[:, :, :n])
        self.length = n


@dataclass
class StepItem:
    """One sequence's share of a step: new tokens appended after `kv.length` cached ones."""

    kv: SeqKV
    ids: list[int]
    want_logits: bool
    logits: torch.Tensor | None = field(default=None, repr=False)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after any of these; the builtin engine has no implicit EOS (the proxy passes
    the tokenizer's stop_token_ids), so SGLang's `ignore_eos` is accepted and has no effect."""
    seed: int | None = None


def run_step(cfg: ModelConfig, weights: dict[str, torch.Tensor], items: list[StepItem]) -> None:
    """Forward all items' new tokens, extend their caches, and set `logits` [V] where wanted."""
    starts = [it.kv.length for it in items]
    ids = torch.tensor([t for it in items for t in it.ids], dtype=torch.long)
    positions = torch.cat([torch.arange(s, s + len(it.ids)) for s, it in zip(starts, items)])
    bounds, off = [], 0
    for it in items:
        bounds.append((off, off + len(it.ids)))
        off += len(it.ids)
        it.kv.reserve(it.kv.length + len(it.ids))

    def attend_fn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = []
        for (a, b), s, it in zip(bounds, starts, items):
            cache = it.kv.data[layer]
            cache[0, s : s + b - a] = k[a:b]
            cache[1, s : s + b - a] = v[a:b]
            outs.append(attend(q[a:b], cache[0, : s + b - a], cache[1, : s + b - a], s))
        return torch.cat(outs)

    hidden = forward_tokens(cfg, weights, ids, positions, attend_fn)
    last = [b - 1 for (a, b), it in zip(bounds, items) if it.want_logits]
    logits = logits_of(cfg, weights, hidden[last]) if last else None
    j = 0
    for (a, b), it in zip(bounds, items):
        it.kv.length += b - a
        if it.want_logits:
            it.logits = logits[j]
            j += 1


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> tuple[int, float]:
    """Pick the next token; returns (token, its log-prob under softmax(logits / T)).

    The log-prob is taken before top-k/top-p truncation, as SGLang reports it; T = 0 is greedy and
    reports log-probs at temperature 1.
    """
    logits = logits.float()
    if p.temperature <= 0:
        tok = int(torch.argmax(logits))
        return tok, float(torch.log_softmax(logits, -1)[tok])
    scaled = logits / p.temperature
    logp = torch.log_softmax(scaled, -1)
    probs = logp.exp()
    if 0 < p.top_k < probs.numel():
        kth = torch.topk(probs, p.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p * sorted_p.sum()
        probs = torch.zeros_like(probs).scatter(0, order, torch.where(keep, sorted_p, 0.0))
    tok = int(torch.multinomial(probs, 1, generator=gen))
    return tok, float(logp[tok])
