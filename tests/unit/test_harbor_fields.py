"""Harbor's task.toml fields as Harbor reads them (network per phase, env templates, users, limits,
refusals by name), reward files as Harbor reads them, and the sandbox refusals those fields lead to."""

import math
from pathlib import Path

import pytest

from gyre.harness.config import HarnessConfig
from gyre.harness.evaluate import EvaluatorFailed, parse_reward
from gyre.harness.podman import qualify_image
from gyre.harness.task_checks import SandboxError, check_isolation
from gyre.tasks.config import TasksConfig
from gyre.tasks.harbor import load_harbor_task
from gyre.tasks.harbor_fields import resolve_env
from gyre.tasks.spec import TaskSpecError
from gyre.tasks.taskset import TaskSet
from gyre.trajectory.rewards import Evaluation


def task_dir(root: Path, toml: str = "", name: str = "t1", files: dict | None = None) -> Path:
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "task.toml").write_text(toml)
    (d / "instruction.md").write_text("do it")
    (d / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    for rel, text in (files or {}).items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


NETWORKS = [  # (id, task.toml, agent's network, asked, verifier's network, asked)
    ("default-public", "", "public", False, "public", False),
    ("allow-internet-false", "[environment]\nallow_internet = false", "none", True, "none", True),
    ("allow-internet-true", "[environment]\nallow_internet = true", "public", True, "public", True),
    ("baseline-no-network", '[environment]\nnetwork_mode = "no-network"', "none", True, "none", True),
    (
        "mode-beats-allow",
        '[environment]\nallow_internet = false\nnetwork_mode = "public"',
        "public",
        True,
        "public",
        True,
    ),
    ("agent-override", '[agent]\nnetwork_mode = "no-network"', "none", True, "public", False),
    ("verifier-override", '[verifier]\nnetwork_mode = "no-network"', "public", False, "none", True),
    ("allowlist-empty-is-none", '[agent]\nnetwork_mode = "allowlist"', "none", True, "public", False),
]


@pytest.mark.parametrize("toml,agent,asked,verifier,v_asked", [pytest.param(*c[1:], id=c[0]) for c in NETWORKS])
def test_network_mode_per_phase(toml, agent, asked, verifier, v_asked, tmp_path):
    env = load_harbor_task(task_dir(tmp_path, toml)).environment
    assert (env.agent_network, env.agent_network_asked) == (agent, asked)
    assert (env.verifier_network, env.verifier_network_asked) == (verifier, v_asked)


BAD = [  # (id, task.toml or files, the field the error names)
    ("network-unknown", '[environment]\nnetwork_mode = "lan"', "environment.network_mode"),
    ("agent-network-unknown", '[agent]\nnetwork_mode = "open"', "agent.network_mode"),
    ("allowlist-hosts", '[agent]\nnetwork_mode = "allowlist"\nallowed_hosts = ["pypi.org"]', "agent.network_mode"),
    ("allow-internet-string", '[environment]\nallow_internet = "yes"', "environment.allow_internet"),
    ("env-missing-host-var", '[verifier]\nenv = { K = "${GYRE_SURELY_UNSET_VAR}" }', "verifier.env"),
    ("env-number", "[environment]\nenv = { K = 1 }", "environment.env"),
    ("solution-env-not-table", '[solution]\nenv = "K=1"', "solution.env"),
    ("agent-user-list", "[agent]\nuser = [1]", "agent.user"),
    ("verifier-user-negative", "[verifier]\nuser = -1", "verifier.user"),
    ("storage-zero", "[environment]\nstorage_mb = 0", "environment.storage_mb"),
    ("build-timeout-negative", "[environment]\nbuild_timeout_sec = -5", "environment.build_timeout_sec"),
    ("gpus-fraction", "[environment]\ngpus = 0.5", "environment.gpus"),
    ("environment-mode-unknown", '[verifier]\nenvironment_mode = "fresh"', "verifier.environment_mode"),
    ("step-healthcheck", '[[steps]]\nname = "one"\n[steps.healthcheck]\ncommand = "true"', "steps[0].healthcheck"),
]


@pytest.mark.parametrize("toml,field", [pytest.param(t, f, id=i) for i, t, f in BAD])
def test_bad_fields_are_refused_by_name(toml, field, tmp_path):
    with pytest.raises(TaskSpecError) as e:
        load_harbor_task(task_dir(tmp_path, toml))
    assert e.value.field_name == field


@pytest.mark.parametrize("name", ["docker-compose.yaml", "compose.yml"])
def test_compose_environment_is_refused_naming_the_file(name, tmp_path):
    with pytest.raises(TaskSpecError) as e:
        load_harbor_task(task_dir(tmp_path, files={f"environment/{name}": "services: {}"}))
    assert e.value.field_name == f"environment/{name}"


TEMPLATES = [  # (id, value, host, resolved): whole-value templates only, as harbor/utils/env.py
    ("literal", "plain", {}, "plain"),
    ("from-host", "${A}", {"A": "x"}, "x"),
    ("default", "${A:-dflt}", {}, "dflt"),
    ("host-beats-default", "${A:-dflt}", {"A": "x"}, "x"),
    ("empty-default", "${A:-}", {}, ""),
    ("embedded-is-literal", "pre-${A}", {"A": "x"}, "pre-${A}"),
]


@pytest.mark.parametrize("value,host,want", [pytest.param(*c[1:], id=c[0]) for c in TEMPLATES])
def test_env_templates_resolve_from_the_host(value, host, want):
    assert resolve_env({"env": {"K": value}}, "verifier", "t", host) == {"K": want}


def test_fields_read_as_harbor_reads_them(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_TEST_TOKEN", "from-host")
    toml = (
        '[agent]\nuser = "agent"\n[verifier]\nuser = 0\nenvironment_mode = "separate"\n'
        'env = { TOKEN = "${GYRE_TEST_TOKEN:-none}" }\n[solution]\nenv = { S = "1" }\n'
        '[environment]\nenv = { E = "2" }\nstorage_mb = 10240\nbuild_timeout_sec = 42\ngpus = 0\n'
    )
    task = load_harbor_task(task_dir(tmp_path, toml))
    env = task.environment
    assert (env.agent_user, env.verifier_user, env.verification) == ("agent", "0", "separate")
    assert (task.evaluator.env, env.solution_env, env.env) == ({"TOKEN": "from-host"}, {"S": "1"}, {"E": "2"})
    assert (env.storage_mb, env.build_timeout_s, env.gpus) == (10240, 42.0, 0)
    assert env.workdir == "/app" and env.verification == "separate"


def test_workdir_comes_from_the_image_unless_the_toml_names_one(tmp_path):
    image = load_harbor_task(task_dir(tmp_path, '[environment]\ndocker_image = "python:3.12"', "a"))
    built = load_harbor_task(task_dir(tmp_path, files={"environment/Dockerfile": "FROM x"}, name="b"))
    named = load_harbor_task(task_dir(tmp_path, '[environment]\ndocker_image = "x"\nworkdir = "/testbed"', "c"))
    assert (image.environment.workdir, built.environment.workdir, named.environment.workdir) == ("", "", "/testbed")


def test_no_agent_timeout_is_bounded_by_the_configured_maximum(tmp_path):
    task_dir(tmp_path, "", "free")
    task_dir(tmp_path, "[agent]\ntimeout_sec = 30", "timed")
    ts = TaskSet.load(tmp_path, TasksConfig(max_agent_timeout_s=123.0))
    assert (ts.get("free").time_budget_s, ts.get("timed").time_budget_s) == (123.0, 30.0)


def test_refusals_name_the_field_and_the_key(tmp_path):
    def refused(toml: str, cfg: HarnessConfig, match: str, name: str):
        task = load_harbor_task(task_dir(tmp_path, toml, name))
        with pytest.raises(SandboxError, match=match):
            check_isolation(task, cfg, bwrap_ok=True, podman_ok=True)

    podman, closed = HarnessConfig(isolation="podman"), HarnessConfig(isolation="podman", agent_network="none")
    refused("[environment]\ngpus = 1", HarnessConfig(), r"\[environment\]\.gpus = 1", "gpu")
    image = '[environment]\ndocker_image = "x"\n'
    refused(image + "allow_internet = true", closed, "harness.agent_network=none", "asks-public")
    refused(image + '[verifier]\nnetwork_mode = "public"', closed, r"\[verifier\]\.network_mode", "verifier-public")
    refused('[verifier]\nnetwork_mode = "no-network"', podman, r"\[verifier\]\.network_mode", "bwrap-verifier-off")
    for toml, cfg in [
        (image, closed),  # the agent gets no network, the verifier shares it
        (image + '[verifier]\nnetwork_mode = "public"\nenvironment_mode = "separate"', closed),
        (image + "storage_mb = 1", podman),
        ("", HarnessConfig(agent_network="none")),  # bubblewrap: a network namespace of its own, and the relay
        ("[environment]\nallow_internet = false", HarnessConfig()),
    ]:
        check_isolation(load_harbor_task(task_dir(tmp_path, toml, f"ok{len(toml)}")), cfg, True, True)


IMAGES = [  # (id, as written, what is pulled)
    ("official", "python:3.12", ["docker.io/library/python:3.12"]),
    ("user", "alexgshaw/fix-git:1", ["docker.io/alexgshaw/fix-git:1"]),
    ("registry", "ghcr.io/a/b:1", ["ghcr.io/a/b:1"]),
    ("registry-port", "reg:5000/a", ["reg:5000/a"]),
    ("local", "localhost/gyre-test:1", ["localhost/gyre-test:1"]),
]


@pytest.mark.parametrize("name,want", [pytest.param(n, w, id=i) for i, n, w in IMAGES])
def test_short_image_names_are_qualified(name, want):
    assert qualify_image(name) == want


def test_image_registries_are_tried_in_order():
    assert qualify_image("user/img", ("quay.io", "docker.io")) == ["quay.io/user/img", "docker.io/user/img"]


REWARDS = [  # (id, reward.txt, reward.json, reward, metrics): reward.json decides when it exists (Harbor)
    ("json-wins-over-txt", "0", '{"reward": 0.2, "passed": 3}', 0.2, {"passed": 3.0}),
    ("json-one-key-wins-over-txt", "1", '{"accuracy": 0.3}', 0.3, {}),
    ("json-reward-key", None, '{"reward": 0.7, "passed": 3, "note": "x"}', 0.7, {"passed": 3.0}),
    ("json-only-key", None, '{"accuracy": 0.3}', 0.3, {}),
    ("above-one-kept", "1.5", None, 1.5, {}),
    ("negative-kept", None, '{"reward": -2}', -2.0, {}),
]


@pytest.mark.parametrize("txt,js,reward,metrics", [pytest.param(*c[1:], id=c[0]) for c in REWARDS])
def test_rewards_as_harbor_reads_them(txt, js, reward, metrics):
    assert parse_reward(txt, js) == (reward, metrics)


def test_several_keys_without_reward_name_them():
    with pytest.raises(EvaluatorFailed, match=r"\['a', 'b'\]"):
        parse_reward(None, '{"a": 0.1, "b": 0.2}')


def test_an_unreadable_reward_json_is_an_error_even_beside_a_reward_txt():
    """Harbor reads reward.json whenever it exists; garbage there fails the verification."""
    with pytest.raises(EvaluatorFailed, match="not JSON"):
        parse_reward("1", "{oops")
    with pytest.raises(EvaluatorFailed, match=r"\['a', 'b'\]"):
        parse_reward("1", '{"a": 0.1, "b": 0.2}')


def test_an_evaluation_keeps_any_finite_score_and_its_metrics():
    assert Evaluation("finished", 1.5, metrics={"passed": 3.0}).score == 1.5
    with pytest.raises(ValueError, match="finite"):
        Evaluation("finished", math.inf)
