"""Every benchmark keeps running: each tools/bench/*.py, found by glob (so a new one without a
smoke mode fails here), runs with --smoke (its smallest sizes, seconds; its docstring says what
that covers), exits 0 and ends its output with one JSON object. Figures are not checked: tests
never time anything.

The selected benchmarks start together, two at a time (two cores), when this module's first test
asks for its result: the module costs about their summed CPU time over two.
"""

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHES = sorted(p.name for p in (ROOT / "tools" / "bench").glob("*.py"))
TIMEOUT_S = 300
"""One smoke run's bound; a run past it (a benchmark that hangs) is killed with its process group."""


def _smoke(name: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `tools/bench/<name> --smoke`."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "tools" / "bench" / name), "--smoke"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its engines and proxies too
        out, err = proc.communicate()
        err += f"\n(killed after {TIMEOUT_S} s)"
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def smoke_runs(request) -> dict[str, Future]:
    """The selected benchmarks' smoke runs, started at once on a pool of two."""
    selected = [
        item.callspec.params["bench"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    ]
    pool = ThreadPoolExecutor(max_workers=2)
    yield {name: pool.submit(_smoke, name) for name in selected}
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("bench", BENCHES)
def test_a_benchmark_runs_in_its_smoke_mode(bench, smoke_runs):
    rc, out, err = smoke_runs[bench].result()
    assert rc == 0, f"{bench} --smoke exited {rc}:\n{err[-4000:]}"
    lines = out.strip().splitlines()
    assert lines, f"{bench} --smoke printed nothing"
    assert isinstance(json.loads(lines[-1]), dict), f"{bench}'s last line is no JSON object: {lines[-1][:500]}"
