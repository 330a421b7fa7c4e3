"""The pytest evaluator on real pytest runs: what the policy caused is scored, the rest is an evaluator error."""

from pathlib import Path

import pytest

from gyre.harness.evaluate import EvaluatorFailed, evaluate, score_pytest_report
from gyre.harness.workspace import make_workspace
from gyre.tasks.spec import parse_task

NEEDS_CALC = "from calc import add\n\ndef test_add():\n    assert add(1, 1) == 2\n"
PASSING = "def test_one():\n    assert True\n\ndef test_two():\n    assert True\n"


def score(tmp_path, files: dict, command="{python} -m pytest -q tests", timeout_s=60.0):
    task = parse_task(
        {
            "task_id": "t",
            "instruction": "write calc.py",
            "workspace": {"files": files},
            "evaluator": {"kind": "pytest", "command": command, "timeout_s": timeout_s},
            "time_budget_s": 30,
        },
        "test",
        Path.cwd(),
    )
    return evaluate(task, make_workspace(task.workspace, tmp_path / "ws"), "finished")


@pytest.mark.parametrize(
    "files,expect",
    [
        pytest.param({"tests/test_calc.py": NEEDS_CALC}, 0.0, id="module-never-written"),
        pytest.param({"tests/test_calc.py": NEEDS_CALC, "calc.py": "def add(a, b) return a"}, 0.0, id="module-broken"),
        pytest.param({"tests/test_calc.py": NEEDS_CALC, "tests/test_other.py": PASSING}, 2 / 3, id="mixed"),
        pytest.param({"tests/test_calc.py": NEEDS_CALC, "calc.py": "def add(a, b):\n    return a + b\n"}, 1.0, id="ok"),
    ],
)
def test_an_uncollectable_test_module_counts_as_a_failed_test(tmp_path, files, expect):
    e = score(tmp_path, files)
    assert (e.outcome, e.score) == ("finished", pytest.approx(expect)), e.detail
    assert ("uncollectable module counted as failed" in e.detail) == (expect < 1.0)


@pytest.mark.parametrize(
    "files,command,timeout_s,why",
    [
        pytest.param(
            {"tests/test_other.py": PASSING}, "{python} -m pytest --no-such-option tests", 60, "exited 4", id="usage"
        ),
        pytest.param(
            {"tests/test_calc.py": NEEDS_CALC}, "{python} -m pytest -q tests/gone.py", 60, "exited 4", id="path-gone"
        ),
        pytest.param(
            {
                "tests/test_other.py": PASSING,
                "conftest.py": "def pytest_collection_finish(session):\n    raise RuntimeError\n",
            },
            "{python} -m pytest -q tests",
            60,
            "exited 3",
            id="internal",
        ),
        pytest.param(
            {"tests/test_none.py": "X = 1\n"}, "{python} -m pytest -q tests", 60, "exited 5", id="none-collected"
        ),
        pytest.param(
            {"tests/test_exit.py": "import pytest\n\ndef test_stop():\n    pytest.exit('stop')\n"},
            "{python} -m pytest -q tests",
            60,
            "exited 2",
            id="interrupted",
        ),
        pytest.param(
            {"tests/test_slow.py": "import time\n\ndef test_slow():\n    time.sleep(30)\n"},
            "{python} -m pytest -q tests",
            1.0,
            "timeout",
            id="timeout",
        ),
        pytest.param({"tests/test_other.py": PASSING}, "true", 60, "no junit report", id="no-report"),
    ],
)
def test_what_the_policy_cannot_cause_is_an_evaluator_error(tmp_path, files, command, timeout_s, why):
    e = score(tmp_path, files, command, timeout_s)
    assert (e.outcome, e.score) == ("evaluator_error", None) and why in e.detail, e.detail


@pytest.mark.parametrize("exit_code", [2, 3, 4, 5])
def test_only_exits_0_and_1_are_scored(exit_code):
    error = '<error message="collection failure"/>'
    xml = f'<testsuite tests="1" errors="1"><testcase name="m">{error}</testcase></testsuite>'
    assert score_pytest_report(1, xml) == (0.0, "0/1 tests passed (1 uncollectable module counted as failed)")
    with pytest.raises(EvaluatorFailed, match=f"exited {exit_code}"):
        score_pytest_report(exit_code, xml)
