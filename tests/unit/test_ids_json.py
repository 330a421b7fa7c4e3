"""The proxy's incremental JSON of prompt ids: always the exact JSON of the ids, cheap when a prompt extends."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.engines.client import EngineClient, IdsJsonCache


def test_extending_prompts_reuse_the_text_and_edits_reencode():
    cache = IdsJsonCache()
    first = list(range(100))
    assert cache.encode("s", first) == json.dumps(first, separators=(",", ":")).encode()
    longer = first + [7, 8, 9]
    assert json.loads(cache.encode("s", longer)) == longer and cache.num_hits == 1
    assert json.loads(cache.encode("s", longer)) == longer and cache.num_hits == 2  # the same prompt again
    edited = [5] + longer[1:]  # the harness edited its history: not a prefix
    assert json.loads(cache.encode("s", edited)) == edited and cache.num_hits == 2
    assert json.loads(cache.encode("t", longer)) == longer and cache.num_hits == 2  # sessions are apart


def test_budget_drops_least_recent_sessions():
    cache = IdsJsonCache(max_tokens=250)
    for name in "abc":
        cache.encode(name, list(range(100)))
    assert cache.num_tokens == 200  # "a" went first
    cache.encode("a", list(range(101)))
    assert cache.num_hits == 0 and cache.num_tokens == 201


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("xy"), st.integers(0, 3), st.lists(st.integers(0, 2**31 - 1), max_size=5)),
                max_size=12))
def test_text_is_always_the_json_of_the_ids(steps):
    """Any mix of extending, cutting and switching sessions: the text parses back to exactly the ids."""
    cache, prompts = IdsJsonCache(max_tokens=30), {"x": [], "y": []}
    for session, cut, extra in steps:
        ids = prompts[session][: max(0, len(prompts[session]) - cut)] + extra
        prompts[session] = ids
        assert json.loads(cache.encode(session, ids)) == ids


def test_generate_payload_with_encoded_ids_is_the_same_request():
    client = EngineClient("http://127.0.0.1:1")
    ids = [1, 2, 3]
    args = ({"max_new_tokens": 2}, "r1", True, False, None)
    plain = json.loads(client._generate_payload(ids, *args, None))
    spliced = json.loads(client._generate_payload(ids, *args, IdsJsonCache().encode("s", ids)))
    assert plain == spliced and plain["input_ids"] == ids and plain["rid"] == "r1"
