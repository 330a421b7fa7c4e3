"""Podman isolation's pure parts (the argv of the agent's and the verifier's containers, the image tag,
what the container's environment gets) and the relay that is the agent's only way to the proxy."""

import asyncio
import dataclasses
import os
import resource
import sys
import time
from pathlib import Path

import pytest

from gyre.harness import podman
from gyre.harness.config import HarnessConfig
from gyre.harness.contract import Mount
from gyre.harness.relay import _listen, parse_address
from gyre.tasks.harbor import load_harbor_task


def harbor_task(root: Path, toml: str = "", name: str = "t1"):
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "environment").mkdir()
    (d / "task.toml").write_text(toml)
    (d / "instruction.md").write_text("do it")
    (d / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (d / "environment" / "Dockerfile").write_text("FROM localhost/base\n")
    return load_harbor_task(d)


def test_verifier_run_argv_has_the_task_limits_and_the_host_open_files_limit(tmp_path):
    task = harbor_task(tmp_path, "[environment]\ncpus = 1.5\nmemory_mb = 512\nworkdir = '/src'")
    mounts = [Mount(Path("/h/ws"), "/src"), Mount(Path("/h/tests"), "/tests", writable=False)]
    argv = podman.make_run_argv(task, "img:1", "gyre-v1", mounts, {"B": "2", "A": "x y"})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert argv == [
        *("podman", "run", "--rm", "--name", "gyre-v1", "--workdir", "/src"),
        *("--ulimit", f"nofile={soft}:{hard}", "--ulimit", f"nproc={podman.DEFAULT_NPROC}:{podman.DEFAULT_NPROC}"),
        *("--cpus", "1.5", "--memory", "512m"),
        *("--volume", "/h/ws:/src:rw", "--volume", "/h/tests:/tests:ro"),
        *("--env", "A=x y", "--env", "B=2"),
        "img:1",
    ]


def test_agent_extras_are_the_relay_the_harness_python_and_its_rlimits(tmp_path):
    task = harbor_task(tmp_path)
    mounts, flags = podman.make_agent_extras(HarnessConfig(max_processes=64, cpu_limit_s=30), task, tmp_path / "r")
    assert flags == ["--ulimit", "nproc=64:64", "--ulimit", "cpu=30:30"]
    assert mounts[0] == Mount(tmp_path / "r", podman.RELAY_DIR)
    assert all(not m.writable for m in mounts[1:]) and any(sys.base_prefix in str(m.source) for m in mounts[1:])
    assert podman.make_relay_argv(8123) == [
        *(sys.executable, "-m", "gyre.harness.relay"),
        *("--listen", "tcp:127.0.0.1:8123", "--to", f"unix:{podman.RELAY_DIR}/proxy.sock", "--"),
    ]
    env = {"GYRE_API_KEY": "k", "PATH": os.environ["PATH"]}  # the host's own PATH stays outside
    assert podman.container_env(env) == {"GYRE_API_KEY": "k"}


def test_harness_mounts_are_minimal_and_refuse_a_system_python(monkeypatch):
    mounts = podman.harness_mounts(["sh"])
    assert not any(a != b and a in b.parents for a in mounts for b in mounts)
    assert not any(str(m) in podman.SYSTEM_DIRS for m in mounts)  # `sh` is the image's own
    assert Path(sys.base_prefix).resolve() in mounts or any(
        m in Path(sys.base_prefix).resolve().parents for m in mounts
    )
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    with pytest.raises(podman.PodmanError, match="harness.isolation=podman: .* /usr"):
        podman.harness_mounts()


def test_dockerfile_tag_changes_with_any_file_of_the_environment(tmp_path):
    env = tmp_path / "environment"
    env.mkdir()
    (env / "Dockerfile").write_text("FROM base\n")
    first = podman.dockerfile_tag("My.Task", env)
    assert first.startswith("localhost/gyre-harbor-my.task:") and podman.dockerfile_tag("My.Task", env) == first
    (env / "data.txt").write_text("x")
    assert podman.dockerfile_tag("My.Task", env) != first


def test_proxy_port_and_container_env(monkeypatch):
    assert podman.proxy_port("http://10.0.0.5:8000") == ("10.0.0.5", 8000)
    assert podman.proxy_port("http://proxy") == ("proxy", 80)
    monkeypatch.setenv("GYRE_SAME", "1")
    monkeypatch.setenv("PYTHONPATH", "/src")
    env = {"GYRE_SAME": "1", "GYRE_NEW": "2", "PYTHONPATH": "/src"}
    assert podman.container_env(env) == {"GYRE_NEW": "2", "PYTHONPATH": "/src"}


@pytest.mark.parametrize(
    "text,want",
    [
        ("tcp:127.0.0.1:8000", ("tcp", ("127.0.0.1", 8000))),
        ("unix:/gyre/relay/proxy.sock", ("unix", "/gyre/relay/proxy.sock")),
        ("fd:3", ("fd", 3)),
    ],
)
def test_relay_addresses(text, want):
    assert parse_address(text) == want


@pytest.mark.parametrize("text", ["tcp:host", "unix:", "fd:x", "udp:1.2.3.4:5"])
def test_relay_refuses_other_addresses(text):
    with pytest.raises(ValueError, match="not an address"):
        parse_address(text)


def test_relay_carries_bytes_both_ways_and_a_half_close(tmp_path):
    async def scenario() -> bytes:
        async def echo(reader, writer):  # answers only after the client's half-close
            writer.write((await reader.read()).upper())
            await writer.drain()
            writer.close()

        target = await asyncio.start_unix_server(echo, path=str(tmp_path / "t.sock"))
        relay = await _listen(("tcp", ("127.0.0.1", 0)), ("unix", str(tmp_path / "t.sock")))
        port = relay.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"x" * 200_000 + b"end")
        writer.write_eof()
        got = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        relay.close()
        target.close()
        return got

    assert asyncio.run(scenario()) == b"X" * 200_000 + b"END"


def test_only_the_harness_install_is_bound_and_a_task_folder_inside_it_is_masked(tmp_path):
    shipped = load_harbor_task(Path(__file__).parents[1] / "harbor_image_tasks" / "hello-image")
    mounts, flags = podman.make_agent_extras(HarnessConfig(), shipped, tmp_path / "r")
    assert "--tmpfs" not in flags  # the source tree (tests, task sets) is not the harness's install
    assert not any(Path(m.source) in Path(shipped.environment.task_dir).parents for m in mounts)
    inside = Path(sys.prefix) / "tasks" / "t1"  # a task set inside the bound venv stays unseen
    task = dataclasses.replace(shipped, environment=dataclasses.replace(shipped.environment, task_dir=str(inside)))
    _, flags = podman.make_agent_extras(HarnessConfig(), task, tmp_path / "r")
    assert ["--tmpfs", f"{inside}:notmpcopyup"] == flags[flags.index("--tmpfs") :][:2]


@pytest.mark.parametrize(
    "toml,verb",
    [
        pytest.param("[environment]\nbuild_timeout_sec = 0.5", "build -t", id="build"),
        pytest.param(
            '[environment]\ndocker_image = "user/img:1"\nbuild_timeout_sec = 0.5',
            "pull docker.io/user/img:1",
            id="pull",
        ),
    ],
)
def test_a_pull_or_build_past_build_timeout_sec_is_an_error_naming_the_task(toml, verb, tmp_path, monkeypatch):
    """A podman whose pull and build hang (and which has no image): [environment].build_timeout_sec bounds each."""
    fake = tmp_path / "bin" / "podman"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\ncase "$1" in build|pull) exec sleep 30;; esac\nexit 125\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    task = harbor_task(tmp_path, toml)
    start = time.monotonic()
    with pytest.raises(
        podman.PodmanError, match=rf"^task 't1': its image cannot be had: podman {verb} took over 0.5 s"
    ):
        podman.ensure_image(task)
    assert time.monotonic() - start < 10
