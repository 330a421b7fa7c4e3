"""The SGLang /generate contract, pure: parse a request body, build a response from a request's state.

Field names and shapes follow SGLang 0.5.x: `input_ids` (or `text`), `sampling_params{max_new_tokens,
temperature, top_p, top_k, stop_token_ids, ignore_eos, sampling_seed}`, `return_logprob`, `stream`,
`rid`; responses carry `text`, `output_ids` and `meta_info{id, finish_reason, prompt_tokens,
completion_tokens, cached_tokens, weight_version, output_token_logprobs: [[logprob, id, null]]}`.
Unknown fields are ignored, as SGLang does. Gyre adds `meta_info.weight_version_spans`: which
weight version produced which output tokens when an update lands mid-generation.
"""

import uuid
from dataclasses import dataclass

from gyre.engines.runner import SamplingParams
from gyre.records.versions import make_version_spans


class BadRequest(ValueError):
    """The body cannot be served; the message names the field (HTTP 400)."""


@dataclass(frozen=True)
class GenerateRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    stream: bool
    extra_key: str | None


def int_list(value, name: str) -> list[int]:
    """`value` if it is a list of integers (types checked in C: a 16K-token prompt costs ~0.3 ms,
    not the ~2 ms of a Python loop)."""
    if not isinstance(value, list) or not set(map(type, value)) <= {int}:
        raise BadRequest(f"{name} must be a list of integers")
    return value


def _number(sp: dict, key: str, default, lo=None, hi=None, integer=False):
    v = sp.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise BadRequest(f"sampling_params.{key} must be {'an integer' if integer else 'a number'}, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"sampling_params.{key}={v} is out of range [{lo}, {hi}]")
    return v


def parse_generate(body, vocab_size: int, context_len: int, encode=None) -> GenerateRequest:
    """Validate a /generate body.

    Args:
        encode: text -> ids, used when the body has `text` instead of `input_ids` (None: text refused).
    Raises:
        BadRequest: naming the offending field.
    """
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            raise BadRequest("batched input_ids (a list of lists) are not supported; send one request per prompt")
        ids = int_list(ids, "input_ids")
    elif isinstance(body.get("text"), str):
        if encode is None:
            raise BadRequest("this engine has no tokenizer for `text`; send input_ids")
        ids = encode(body["text"])
    else:
        raise BadRequest("missing input_ids (or text)")
    if not ids:
        raise BadRequest("input_ids is empty")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise BadRequest(f"input_ids has {len(bad)} ids outside the vocabulary [0, {vocab_size}), e.g. {bad[0]}")
    sp = body.get("sampling_params")
    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be an object")
    max_new = _number(sp, "max_new_tokens", 128, lo=0, integer=True)
    if len(ids) + max_new > context_len:
        raise BadRequest(
            f"input ({len(ids)} tokens) + max_new_tokens ({max_new}) exceeds the context window of {context_len} tokens"
        )
    seed = sp.get("sampling_seed", sp.get("seed"))
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"sampling_params.sampling_seed must be an integer, got {seed!r}")
    params = SamplingParams(
        max_new_tokens=max_new,
        temperature=float(_number(sp, "temperature", 1.0, lo=0.0)),
        top_p=float(_number(sp, "top_p", 1.0, lo=1e-9, hi=1.0)),
        top_k=_number(sp, "top_k", -1, lo=-1, integer=True),
        stop_token_ids=tuple(int_list(sp.get("stop_token_ids") or [], "sampling_params.stop_token_ids")),
        seed=seed,
    )
    rid = body.get("rid") or uuid.uuid4().hex
    if not isinstance(rid, str):
        raise BadRequest("rid must be a string")
    extra_key = body.get("extra_key")
    return GenerateRequest(
        rid,
        ids,
        params,
        bool(body.get("return_logprob", False)),
        bool(body.get("stream", False)),
        None if extra_key is None else str(extra_key),
    )


def make_response(req, text: str, weight_version: int, return_logprob: bool, latency_s: float) -> dict:
    """The /generate response (or one stream chunk; cumulative like SGLang's default) for `req`."""
    meta = {
        "id": req.rid,
        "finish_reason": req.finish,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "weight_version": req.versions[-1] if req.versions else weight_version,
        "weight_version_spans": [s.to_wire() for s in make_version_spans(req.versions)],
        "e2e_latency": latency_s,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, req.output_ids)]
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}
