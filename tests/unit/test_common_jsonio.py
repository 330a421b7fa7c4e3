"""jsonio: orjson underneath, Python's json for what orjson cannot write or read."""

import json

import numpy as np
import pytest

from gyre.common import jsonio


@pytest.mark.parametrize(
    "value",
    [
        pytest.param({"b": 1, "a": [1, 2.5, None, True, "é"]}, id="plain"),
        pytest.param({"n": 2**70}, id="integer-past-64-bits"),
        pytest.param({1: "int key"}, id="non-string-key"),
    ],
)
def test_what_it_writes_reads_back_as_json_reads_it(value):
    text = jsonio.dumps(value)
    assert jsonio.loads(text) == json.loads(text) == json.loads(json.dumps(value))
    assert jsonio.loads(jsonio.dumpb(value)) == json.loads(text)
    assert ", " not in text and ": " not in text  # compact


def test_numpy_values_are_written_as_lists_and_numbers_and_default_is_asked_for_the_rest():
    assert jsonio.loads(jsonio.dumpb({"a": np.arange(3, dtype=np.int32), "f": np.float32(0.5)})) == {
        "a": [0, 1, 2],
        "f": 0.5,
    }
    assert jsonio.dumps({"x": {1, 2}}, default=sorted) == '{"x":[1,2]}'
    with pytest.raises(TypeError):
        jsonio.dumps({"x": object()})


def test_python_text_and_indent_are_exactly_what_json_writes():
    tool = {"name": "run", "parameters": {"type": "object", "é": 1}}
    assert jsonio.dumps(tool, sort_keys=True, python_text=True) == json.dumps(tool, sort_keys=True)
    assert jsonio.dumps(tool, indent=1) == json.dumps(tool, indent=1)


def test_sorted_keys_nan_read_and_a_decode_error_that_is_a_value_error():
    assert jsonio.dumps({"b": 1, "a": 2}, sort_keys=True) == '{"a":2,"b":1}'
    assert np.isnan(jsonio.loads('{"loss": NaN}')["loss"])  # as Python's json wrote it
    with pytest.raises(jsonio.DecodeError) as bad:
        jsonio.loads(b"{not json")
    assert isinstance(bad.value, ValueError)
