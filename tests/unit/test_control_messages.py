"""Control messages and their codec (pure): fields are type-checked when built and when decoded;
only registered messages and the tensors a Work carries can be unpickled."""

import pickle

import pytest

from gyre.control import messages as m
from gyre.control.transport import decode, encode


@pytest.mark.parametrize(
    "build, match",
    [
        pytest.param(lambda: m.Work(index="0", version=1, slot=0, batch=None), "Work.index", id="str-index"),
        pytest.param(lambda: m.RoleSwitch("cell2", "train"), "RoleSwitch.cell", id="cell-name-for-index"),
        pytest.param(lambda: m.PhaseDone(2, "pull_weights", True), "PhaseDone.seconds", id="bool-seconds"),
        pytest.param(lambda: m.WeightVersion("3"), "WeightVersion.version", id="str-version"),
    ],
)
def test_building_a_malformed_message_fails_at_once(build, match):
    with pytest.raises(m.ProtocolError, match=match):
        build()


@pytest.mark.parametrize(
    "data, match",
    [
        pytest.param(b"\x80\x05garbage", "undecodable", id="not-a-pickle"),
        pytest.param(pickle.dumps({"claim": 1}), "not a control message", id="plain-dict"),
        pytest.param(pickle.dumps(print), "may not contain builtins.print", id="forbidden-global"),
        pytest.param(pickle.dumps(pytest.raises), "may not contain", id="foreign-module"),
    ],
)
def test_decoding_anything_but_a_message_is_a_protocol_error(data, match):
    with pytest.raises(m.ProtocolError, match=match):
        decode(data)


def test_a_message_with_a_field_of_the_wrong_type_is_refused_on_arrival():
    forged = pickle.dumps(m.Heartbeat("cell1", 1.0)).replace(b"cell1", b"cell9")
    assert decode(forged) == m.Heartbeat("cell9", 1.0)
    tampered = m.Heartbeat.__new__(m.Heartbeat)
    object.__setattr__(tampered, "cell", 1.5)  # bypasses __init__, as unpickling does
    object.__setattr__(tampered, "t", 0.0)
    with pytest.raises(m.ProtocolError, match="Heartbeat.cell"):
        decode(pickle.dumps(tampered))
    with pytest.raises(m.ProtocolError, match="Heartbeat.cell"):
        encode(tampered)
    assert decode(encode(m.Failure(3, "engine exited 1"))) == m.Failure(3, "engine exited 1")
