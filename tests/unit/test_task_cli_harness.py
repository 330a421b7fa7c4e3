"""gyre-task run's harness config: conf/harness/<kind>.yaml with --set overrides, checked as gyre-train does."""

import pytest

from gyre.errors import ConfigError
from gyre.launch.task_cli import harness_config


def test_the_harness_yaml_and_set_overrides_compose_as_gyre_train_composes_them():
    qwen = harness_config("qwen_code", ["harness.qwen_code_tools=[run_shell_command]"], isolation="none")
    assert (qwen.kind, qwen.mem_limit_gb, qwen.grace_s) == ("qwen_code", None, 10.0)  # its yaml's, not the defaults
    assert qwen.qwen_code_tools == ["run_shell_command"] and qwen.isolation == "none"
    assert harness_config("toy", []).mem_limit_gb == 4.0
    assert "answer.txt" in harness_config("command", []).command  # its yaml's command unless --command names one
    assert harness_config("toy", ["harness.isolation=none"]).isolation == "none"  # kept where --isolation is not given


BAD = [("grace_s=1", "--set"), ("harness.grace_s=-1", "harness.grace_s"), ("harness.kind=nope", "harness.kind")]


@pytest.mark.parametrize("override, key", BAD)
def test_a_bad_override_is_refused_naming_its_key(override, key):
    with pytest.raises(ConfigError) as e:
        harness_config("toy", [override])
    assert e.value.key == key
