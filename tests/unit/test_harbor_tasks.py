"""Harbor task folders: the loading table (each bad field named), discovery, reward files, isolation refusals."""

from pathlib import Path

import pytest

from gyre.harness.config import HarnessConfig
from gyre.harness.contract import Mount, make_contract_prefix
from gyre.harness.evaluate import EvaluatorFailed, parse_reward
from gyre.harness.sandbox import SandboxError, check_isolation, make_limits_prefix
from gyre.tasks.harbor import find_task_dirs, load_harbor_task
from gyre.tasks.spec import TaskSpecError
from gyre.tasks.taskset import TaskSet

SET = Path(__file__).parents[1] / "harbor_tasks"


def make_task(root: Path, name: str = "t1", toml: str = "", instruction="do it", test_sh=True, files=None) -> Path:
    """A Harbor task folder; `files` maps relative paths (environment/..., solution/...) to text."""
    d = root / name
    d.mkdir(parents=True)
    (d / "task.toml").write_text(toml)
    if instruction is not None:
        (d / "instruction.md").write_text(instruction)
    if test_sh:
        (d / "tests").mkdir()
        (d / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    for rel, text in (files or {}).items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


BAD = [
    ("toml-garbage", {"toml": "[agent\ntimeout_sec = 1"}, "task.toml"),
    ("no-instruction", {"instruction": None}, "instruction.md"),
    ("empty-instruction", {"instruction": " \n"}, "instruction.md"),
    ("no-test-sh", {"test_sh": False}, "tests/test.sh"),
    ("agent-not-table", {"toml": "agent = 5"}, "agent"),
    ("agent-timeout-negative", {"toml": "[agent]\ntimeout_sec = -1"}, "agent.timeout_sec"),
    ("agent-timeout-string", {"toml": '[agent]\ntimeout_sec = "10"'}, "agent.timeout_sec"),
    ("agent-timeout-bool", {"toml": "[agent]\ntimeout_sec = true"}, "agent.timeout_sec"),
    ("verifier-timeout-zero", {"toml": "[verifier]\ntimeout_sec = 0"}, "verifier.timeout_sec"),
    ("verifier-env-not-table", {"toml": '[verifier]\nenv = "A=1"'}, "verifier.env"),
    ("verifier-env-number", {"toml": "[verifier]\nenv = { A = 1 }"}, "verifier.env"),
    ("cpus-negative", {"toml": "[environment]\ncpus = -2"}, "environment.cpus"),
    ("memory-mb-zero", {"toml": "[environment]\nmemory_mb = 0"}, "environment.memory_mb"),
    ("memory-no-unit", {"toml": '[environment]\nmemory = "2048"'}, "environment.memory"),
    ("memory-garbage", {"toml": '[environment]\nmemory = "lots"'}, "environment.memory"),
    ("image-not-string", {"toml": "[environment]\ndocker_image = 5"}, "environment.docker_image"),
    ("workdir-relative", {"toml": '[environment]\nworkdir = "app"'}, "environment.workdir"),
    ("workdir-root", {"toml": '[environment]\nworkdir = "/"'}, "environment.workdir"),
    ("workdir-in-tests", {"toml": '[environment]\nworkdir = "/tests/x"'}, "environment.workdir"),
    ("workdir-hides-usr", {"toml": '[environment]\nworkdir = "/usr/src/app"'}, "environment.workdir"),
    ("name-with-space", {"name": "my task"}, "task_id"),
    ("internet-not-bool", {"toml": '[environment]\nallow_internet = "no"'}, "environment.allow_internet"),
]


@pytest.mark.parametrize("kwargs,field", [pytest.param(k, f, id=i) for i, k, f in BAD])
def test_bad_folder_names_folder_and_field(kwargs, field, tmp_path):
    folder = make_task(tmp_path, **kwargs)
    with pytest.raises(TaskSpecError) as e:
        load_harbor_task(folder)
    assert e.value.field_name == field
    assert e.value.where == f"harbor task {folder}"


GOOD = [
    ("defaults", {}, dict(time_budget_s=4 * 3600.0, timeout_s=600.0, workdir="/app", memory_mb=None, cpus=None)),
    (
        "full",
        {
            "toml": '[agent]\ntimeout_sec = 30\n[verifier]\ntimeout_sec = 9.5\nenv = { K = "v" }\n'
            '[environment]\ncpus = 2\nmemory_mb = 1024\nworkdir = "/srv/x"\n[metadata]\ntags = ["a"]'
        },
        dict(time_budget_s=30.0, timeout_s=9.5, workdir="/srv/x", memory_mb=1024, cpus=2.0, env={"K": "v"}),
    ),
    ("memory-string", {"toml": '[environment]\nmemory = "4G"'}, dict(memory_mb=4096)),
    ("memory-mib", {"toml": '[environment]\nmemory = "512Mi"'}, dict(memory_mb=512)),
    ("image", {"toml": '[environment]\ndocker_image = "python:3.12"'}, dict(image="python:3.12")),
]


@pytest.mark.parametrize("kwargs,want", [pytest.param(k, w, id=i) for i, k, w in GOOD])
def test_good_folder(kwargs, want, tmp_path):
    t = load_harbor_task(make_task(tmp_path, **kwargs))
    env = t.environment
    got = dict(
        time_budget_s=t.time_budget_s,
        timeout_s=t.evaluator.timeout_s,
        workdir=env.workdir,
        memory_mb=env.memory_mb,
        cpus=env.cpus,
        env=t.evaluator.env,
        image=env.image,
    )
    assert {k: got[k] for k in want} == want
    assert t.task_id == "t1" and t.instruction == "do it" and t.evaluator.kind == "harbor"


def test_workspace_reference_and_dockerfile(tmp_path):
    bare = load_harbor_task(make_task(tmp_path, "bare"))
    assert bare.workspace.kind == "files" and not bare.workspace.files and bare.reference is None
    full = load_harbor_task(
        make_task(tmp_path, "full", files={"environment/a.txt": "x", "solution/solve.sh": "echo x > b"})
    )
    assert full.workspace.kind == "dir" and full.workspace.location == str(tmp_path / "full" / "environment")
    assert full.reference == {"solve_sh": str(tmp_path / "full" / "solution" / "solve.sh")}
    built = load_harbor_task(make_task(tmp_path, "built", files={"environment/Dockerfile": "FROM debian"}))
    assert built.environment.image == str(tmp_path / "built" / "environment" / "Dockerfile")


def test_discovery_nested_depth_and_duplicates(tmp_path):
    make_task(tmp_path / "a")
    make_task(tmp_path / "b" / "c", "t2")
    make_task(tmp_path / "x" / "y" / "z" / "w", "too-deep")
    assert [d.name for d in find_task_dirs(tmp_path)] == ["t1", "t2"]
    assert [t.task_id for t in TaskSet.load(tmp_path).tasks] == ["t1", "t2"]
    assert [t.task_id for t in TaskSet.load(tmp_path / "a" / "t1").tasks] == ["t1"]  # a task folder is a set of one
    make_task(tmp_path / "d", "t2")
    with pytest.raises(TaskSpecError, match="task 't2': task_id: used by more than one task"):
        TaskSet.load(tmp_path)


def test_shipped_set_loads():
    ts = TaskSet.load(SET)
    assert sorted(t.task_id for t in ts.tasks) == ["fix-greeting", "hello-file", "word-count"]
    assert ts.get("fix-greeting").environment.workdir == "/srv/greet"
    assert ts.get("word-count").evaluator.env == {"EXPECTED_FILE": "count.txt"}


REWARDS = [
    ("txt-one", "1", None, 1.0),
    ("txt-spaces", " 0.25\n", None, 0.25),
    ("json-reward", None, '{"reward": 0.7}', 0.7),
    ("json-reward-among-keys", None, '{"reward": 1, "tests_passed": 5}', 1.0),
    ("json-one-key", None, '{"score": 0.3}', 0.3),
]
REWARD_ERRORS = [
    ("missing", None, None, "no reward file"),
    ("txt-garbage", "passed", None, "not one number"),
    ("txt-empty", "", None, "not one number"),
    ("txt-two-numbers", "1 0", None, "not one number"),
    ("txt-nan", "nan", None, "must be a finite number"),
    ("json-garbage", None, "{reward: 1", "not JSON"),
    ("json-list", None, "[1]", "must be an object"),
    ("json-empty", None, "{}", '"reward" key'),
    ("json-several-keys", None, '{"a": 0.1, "b": 0.2}', r"\['a', 'b'\]"),
    ("json-string", None, '{"reward": "1"}', "must be a finite number"),
    ("json-bool", None, '{"reward": true}', "must be a finite number"),
]


@pytest.mark.parametrize("txt,js,want", [pytest.param(t, j, w, id=i) for i, t, j, w in REWARDS])
def test_reward_files(txt, js, want):
    assert parse_reward(txt, js)[0] == want


@pytest.mark.parametrize("txt,js,match", [pytest.param(t, j, m, id=i) for i, t, j, m in REWARD_ERRORS])
def test_reward_file_errors(txt, js, match):
    with pytest.raises(EvaluatorFailed, match=match):
        parse_reward(txt, js)


def test_isolation_refusals_name_task_and_key(tmp_path):
    plain = load_harbor_task(make_task(tmp_path, "plain"))
    image = load_harbor_task(make_task(tmp_path, "img", '[environment]\ndocker_image = "python:3.12"'))
    built = load_harbor_task(make_task(tmp_path, "built", files={"environment/Dockerfile": "FROM debian"}))
    offline = load_harbor_task(make_task(tmp_path, "offline", "[environment]\nallow_internet = false"))
    offline_image = load_harbor_task(
        make_task(tmp_path, "offline-img", '[environment]\nallow_internet = false\ndocker_image = "python:3.12"')
    )
    podman = HarnessConfig(isolation="podman")
    for task, cfg in [
        (plain, HarnessConfig()),
        (plain, podman),
        (image, podman),
        (built, podman),
        (offline_image, podman),
    ]:
        check_isolation(task, cfg, bwrap_ok=True, podman_ok=True)
    cases = [(image, HarnessConfig(), True, True), (built, HarnessConfig(isolation="bwrap"), True, True)]
    cases += [(image, podman, True, False), (built, podman, True, False)]  # podman cannot run here
    cases += [(plain, HarnessConfig(isolation="none"), True, True), (plain, HarnessConfig(), False, True)]
    cases += [(plain, podman, False, True)]  # a task without an image still needs bubblewrap
    for task, cfg, bwrap_ok, podman_ok in cases:
        with pytest.raises(SandboxError, match=rf"^task '{task.task_id}': harness\.isolation"):
            check_isolation(task, cfg, bwrap_ok=bwrap_ok, podman_ok=podman_ok)
    for cfg in (HarnessConfig(), podman):  # bubblewrap gives it a network namespace of its own
        check_isolation(offline, cfg, bwrap_ok=True, podman_ok=True)


def test_contract_prefix_layout():
    system = [("bin", "usr/bin"), ("usr", None), ("etc", None)]
    mounts = [
        Mount(Path("/venv"), "/venv", writable=False),
        Mount(Path("/h/ws"), "/app"),
        Mount(Path("/h/t"), "/tests", writable=False),
        Mount(Path("/work/h"), "/work/h"),
    ]
    argv = make_contract_prefix(system, [("/etc/shadow", False)], mounts, "/app", hide=["/work/set/t1"])
    assert " ".join(argv) == (
        "bwrap --tmpfs / --symlink usr/bin /bin --ro-bind /usr /usr --ro-bind /etc /etc "
        "--ro-bind /dev/null /etc/shadow "
        "--dev /dev --proc /proc --tmpfs /tmp --tmpfs /work/set/t1 --ro-bind /venv /venv --bind /h/ws /app "
        "--ro-bind /h/t /tests --bind /work/h /work/h "
        "--unshare-pid --die-with-parent --chdir /app --"
    )
    usr_workdir = make_contract_prefix(system, [], [Mount(Path("/h/ws"), "/usr/src/app")], "/usr/src/app")
    assert "/usr" not in usr_workdir[: usr_workdir.index("--dev")]  # the workdir's top folder is not the host's


def test_task_memory_lowers_the_harness_rlimit_only_where_it_has_one():
    assert "--as=1073741824" in make_limits_prefix(HarnessConfig(mem_limit_gb=4.0), memory_mb=1024)
    assert f"--as={2 * 2**30}" in make_limits_prefix(HarnessConfig(mem_limit_gb=2.0), memory_mb=8192)
    assert not any(a.startswith("--as") for a in make_limits_prefix(HarnessConfig(mem_limit_gb=None), memory_mb=1024))
