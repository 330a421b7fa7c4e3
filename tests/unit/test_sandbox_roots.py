"""The allowlist root of every sandbox kind (gyre/harness/roots.py)."""

import os
from pathlib import Path

import pytest

import gyre
from gyre.harness.roots import harness_installs, install_root, make_root_args, program_installs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "program,install",
    [
        pytest.param("/tmp/c/.venv/bin/mini", "/tmp/c/.venv", id="venv"),
        pytest.param("/opt/h/node_modules/@openai/codex/vendor/x/codex", "/opt/h", id="npm-prefix"),
        pytest.param("/srv/tools/agent", "/srv/tools", id="plain-folder"),
        pytest.param("/root/bin/agent", "/root/bin/agent", id="home-prefix: only the program"),
        pytest.param("/home/u/agent", "/home/u/agent", id="home-folder: only the program"),
        pytest.param("/root/.local/bin/claude", "/root/.local", id="user-prefix"),
    ],
)
def test_install_root(program, install):
    assert install_root(Path(program)) == Path(install)


def test_root_args_bind_system_folders_mask_secrets_and_add_installs():
    argv = make_root_args(
        [("usr", None), ("lib", "usr/lib"), ("etc", None)],
        [("/etc/shadow", False), ("/etc/ssl/private", True)],
        [Path("/tmp/c/.venv")],
    )
    assert " ".join(argv) == (
        "--tmpfs / --ro-bind /usr /usr --symlink usr/lib /lib --ro-bind /etc /etc "
        "--ro-bind /dev/null /etc/shadow --tmpfs /etc/ssl/private --dev /dev --proc /proc --tmpfs /tmp "
        "--ro-bind /tmp/c/.venv /tmp/c/.venv"
    )


def test_a_script_brings_its_interpreters_install(tmp_path):
    venv, node = tmp_path / "venv" / "bin", tmp_path / "node" / "bin"
    for folder in (venv, node):
        folder.mkdir(parents=True)
    (node / "node").write_text("")
    (venv / "agent").write_text("#!/usr/bin/env -S node --flag\n")
    for f in (node / "node", venv / "agent"):
        f.chmod(0o755)
    assert program_installs(str(venv / "agent"), path=str(node)) == {tmp_path / "venv", tmp_path / "node"}
    assert program_installs("no-such-harness", path=str(node)) == set()


def test_harness_installs_are_the_install_not_the_source_tree():
    installs = harness_installs(["sh"])
    assert Path(os.path.realpath(gyre.__file__)).parent in installs  # the toy agent imports gyre
    assert ROOT not in installs and not any(p in ROOT.parents for p in installs)  # no tests, task sets, runs
    assert not any(p == Path(d) or Path(d) in p.parents for p in installs for d in ("/usr", "/etc"))
    assert not any(a != b and a in b.parents for a in installs for b in installs)


def test_the_script_an_interpreter_runs_is_bound_and_no_other_named_file(tmp_path):
    script, other = tmp_path / "agent.py", tmp_path / "secret.txt"
    script.write_text("")
    other.write_text("")
    assert script in harness_installs(["python3", str(script), str(other)])
    assert not {script, other, tmp_path} & set(harness_installs(["sh", "-c", "cat $0", str(other)]))
