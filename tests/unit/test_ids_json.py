"""Prompt ids as the proxy sends them: built from an earlier prompt's prefix plus new pieces, the
JSON is always exactly the JSON of the ids, and splicing it into /generate is the same request."""

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.engines.client import EngineClient
from gyre.proxy.render import PromptIds, RenderCheckpoint, RenderResult

pieces = st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=5), max_size=6)


@settings(max_examples=300, deadline=None)
@given(pieces, st.integers(0, 6), pieces, st.integers(0, 6), pieces)
def test_prompt_from_a_checkpoint_is_the_json_of_its_ids(first, cut, second, cut2, third):
    """Any pieces, resumed from any of their points with any further pieces, twice (a continuation
    and a branch, sharing one IdBuffer): ids and JSON agree, and no prompt's ids change later."""
    ids = PromptIds()
    points = [RenderCheckpoint(0, 0, 1, 0, 0, True)]  # after "[": one piece
    for p in first:
        ids.add(p)
        points.append(RenderCheckpoint(0, ids.num_ids, ids.num_json, 0, 0, True))
    arr, pieces = ids.finish()
    text = b"".join(pieces)
    assert json.loads(text) == arr.tolist() == [i for p in first for i in p] and arr.dtype == np.int32
    base, done = RenderResult(arr, pieces, 0, 0, ids_buffer=ids.buffer), [(arr, arr.tolist())]
    for cut_at, more in ((cut, second), (cut2, third)):
        at = points[min(cut_at, len(points) - 1)]
        again = PromptIds(base, at)
        for p in more:
            again.add(p)
        arr2, pieces2 = again.finish()
        assert (
            json.loads(b"".join(pieces2)) == arr2.tolist() == arr[: at.num_ids].tolist() + [i for p in more for i in p]
        )
        done.append((arr2, arr2.tolist()))
    assert all(a.tolist() == seen for a, seen in done), "a later prompt changed an earlier one's ids"


def test_generate_payload_with_encoded_ids_is_the_same_request():
    client = EngineClient("http://127.0.0.1:1")
    ids = [1, 2, 3]
    args = ({"max_new_tokens": 2}, "r1", True, False, None)
    plain = json.loads(client._generate_payload(ids, *args, None))
    spliced = json.loads(client._generate_payload((), *args, PromptIds.of(ids)[1]))
    assert plain == spliced and plain["input_ids"] == ids and plain["rid"] == "r1"
