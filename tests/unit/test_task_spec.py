"""Task specs: the validation table (each bad field named), task-set loading and the seeded draw order."""

import json
from pathlib import Path

import pytest

from gyre.common import CONF_DIR
from gyre.errors import ConfigError
from gyre.harness.commands import make_template_command
from gyre.harness.config import HarnessConfig
from gyre.harness.sandbox import make_bwrap_prefix, make_container_prefix
from gyre.tasks.spec import TaskSpecError, parse_task
from gyre.tasks.taskset import TaskSet, toy_taskset

CONF = Path(CONF_DIR)
GOOD = {
    "task_id": "t1",
    "instruction": "do it",
    "workspace": {"files": {"a.txt": "x"}},
    "setup": None,
    "evaluator": {"kind": "files", "files": {"a.txt": "y"}},
    "time_budget_s": 5,
}

BAD = [
    ("not-object", [], "(spec)"),
    ("unknown-field", {**GOOD, "budget": 3}, "budget"),
    ("empty-id", {**GOOD, "task_id": ""}, "task_id"),
    ("id-with-slash", {**GOOD, "task_id": "a/b"}, "task_id"),
    ("no-instruction", {**GOOD, "instruction": "  "}, "instruction"),
    ("two-workspaces", {**GOOD, "workspace": {"files": {}, "dir": "x"}}, "workspace"),
    ("missing-dir", {**GOOD, "workspace": {"dir": "does-not-exist"}}, "workspace.dir"),
    ("missing-tar", {**GOOD, "workspace": {"tar": "nope.tar.gz"}}, "workspace.tar"),
    ("git-no-commit", {**GOOD, "workspace": {"git": "https://example.org/r.git"}}, "workspace.commit"),
    ("file-escapes", {**GOOD, "workspace": {"files": {"../x": "y"}}}, "workspace.files"),
    ("setup-not-str", {**GOOD, "setup": ["make"]}, "setup"),
    ("budget-zero", {**GOOD, "time_budget_s": 0}, "time_budget_s"),
    ("budget-bool", {**GOOD, "time_budget_s": True}, "time_budget_s"),
    ("evaluator-kind", {**GOOD, "evaluator": {"kind": "magic"}}, "evaluator.kind"),
    ("evaluator-no-command", {**GOOD, "evaluator": {"kind": "pytest"}}, "evaluator.command"),
    ("evaluator-no-files", {**GOOD, "evaluator": {"kind": "files", "files": {}}}, "evaluator.files"),
    (
        "evaluator-timeout",
        {**GOOD, "evaluator": {"kind": "json_score", "command": "x", "timeout_s": -1}},
        "evaluator.timeout_s",
    ),
    ("reference-shape", {**GOOD, "reference": {"patch": "..."}}, "reference"),
]


@pytest.mark.parametrize("obj,field", [pytest.param(o, f, id=i) for i, o, f in BAD])
def test_bad_spec_names_task_and_field(obj, field, tmp_path):
    with pytest.raises(TaskSpecError) as e:
        parse_task(obj, "line 1", tmp_path)
    assert e.value.field_name == field
    tid = obj.get("task_id") if isinstance(obj, dict) else None
    assert e.value.where == (f"task {tid!r}" if tid else "line 1")


def test_good_spec_and_relative_dir(tmp_path):
    (tmp_path / "ws").mkdir()
    t = parse_task({**GOOD, "workspace": {"dir": "ws"}, "reference": {"files": {"a.txt": "y"}}}, "x", tmp_path)
    assert (
        t.workspace.location == str(tmp_path / "ws")
        and t.time_budget_s == 5.0
        and t.reference == {"files": {"a.txt": "y"}}
    )


def test_load_jsonl_and_directory_and_errors(tmp_path):
    lines = [json.dumps({**GOOD, "task_id": f"t{i}"}) for i in range(3)]
    (tmp_path / "set.jsonl").write_text("\n".join(lines) + "\n\n")
    assert [t.task_id for t in TaskSet.load(tmp_path / "set.jsonl").tasks] == ["t0", "t1", "t2"]
    d = tmp_path / "dir"
    d.mkdir()
    for i in range(2):
        (d / f"{i}.json").write_text(json.dumps({**GOOD, "task_id": f"d{i}"}))
    assert len(TaskSet.load(d)) == 2
    (tmp_path / "bad.jsonl").write_text(lines[0] + "\n{oops\n")
    with pytest.raises(TaskSpecError, match="bad.jsonl line 2"):
        TaskSet.load(tmp_path / "bad.jsonl")
    (tmp_path / "dup.jsonl").write_text(lines[0] + "\n" + lines[0] + "\n")
    with pytest.raises(TaskSpecError, match="task 't0': task_id: used by more than one task"):
        TaskSet.load(tmp_path / "dup.jsonl")
    with pytest.raises(TaskSpecError, match="no such task set"):
        TaskSet.load(tmp_path / "missing.jsonl")


def test_pick_is_seeded_cycles_epochs_and_resumes():
    ts = toy_taskset()
    n = len(ts)
    first = [ts.pick(7, c).task_id for c in range(2 * n)]
    assert first == [ts.pick(7, c).task_id for c in range(2 * n)]  # deterministic: a resume continues the cursor
    assert sorted(first[:n]) == sorted(t.task_id for t in ts.tasks) == sorted(first[n:])  # each task once per epoch
    assert first[:n] != first[n:]  # a fresh permutation per epoch
    assert first[:n] != [ts.pick(8, c).task_id for c in range(n)]


def test_harness_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="^kind: 'cc' is not one of"):
        HarnessConfig(kind="cc")
    with pytest.raises(ConfigError, match="^command: bad placeholder 'key'"):
        HarnessConfig(kind="command", command="agent {key}")
    with pytest.raises(ConfigError, match=r"^toy\.api: 'grpc'"):
        HarnessConfig(toy={"api": "grpc"})


def test_command_placeholders_keep_values_one_word():
    argv = make_template_command(
        "agent --task {instruction} --url={proxy_url}/v1 '{{literal}}'",
        {
            "instruction": "fix the bug; rm -rf /",
            "proxy_url": "http://h:1",
            "workspace": "",
            "api_key": "",
            "model": "",
        },
    )
    assert argv == ["agent", "--task", "fix the bug; rm -rf /", "--url=http://h:1/v1", "{literal}"]


def test_bwrap_prefix_binds_only_the_writable_paths(tmp_path):
    argv = make_bwrap_prefix(
        ["--tmpfs", "/", "--ro-bind", "/usr", "/usr"], [tmp_path / "ws", tmp_path / "home"], tmp_path / "ws"
    )
    assert argv[:6] == ["bwrap", "--tmpfs", "/", "--ro-bind", "/usr", "/usr"]
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
    assert binds == [str(tmp_path / "ws"), str(tmp_path / "home")] and argv[-1] == "--"
    assert argv.index("--bind") < argv.index("--remount-ro")  # then the rest of the root read-only


def test_container_prefix_binds_workspace_and_home(tmp_path):
    ws, home = tmp_path / "ws", tmp_path / "home"
    assert make_container_prefix("img.sif", [ws, home], ws) == [
        "apptainer",
        "exec",
        "--contain",
        "--bind",
        f"{ws},{home}",
        "--pwd",
        str(ws),
        "img.sif",
    ]
    assert make_container_prefix("img", [ws], ws, "enroot") == [
        "enroot",
        "start",
        "--rw",
        "--mount",
        f"{ws}:{ws}",
        "img",
    ]


def test_tasks_config_yaml_matches_and_validates():
    import yaml  # PyYAML comes with Hydra

    from gyre.tasks.config import TasksConfig

    assert TasksConfig(**yaml.safe_load(open(CONF / "tasks/toy.yaml"))) == TasksConfig()
    with pytest.raises(ConfigError, match="^warm_start_dir"):
        TasksConfig(warm_start_dir="")
    toy = yaml.safe_load(open(CONF / "harness/toy.yaml"))
    assert toy.pop("defaults") == [{"override /trajectory@_global_.trajectory": "toy"}]  # its path cap
    assert HarnessConfig(**toy) == HarnessConfig(grace_s=2.0)
    for name in ("claude_code", "mini_swe_agent", "codex", "command"):
        assert HarnessConfig(**yaml.safe_load(open(CONF / f"harness/{name}.yaml"))).kind == name
