"""Shared pytest set-up: marker gating for `gpu` and `slurm` tests, single-threaded torch, and
free ports reserved for a test's length."""

import contextlib
import os
import shutil
import subprocess

import pytest
from hypothesis import settings

from gyre.common.ports import PortReservation

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Property tests draw the same examples on every run (CI included): a failure found once is found again,
# and a rare example cannot fail one CI run out of many. Widen the search locally with max_examples.
settings.register_profile("gyre", derandomize=True, database=None)
settings.load_profile("gyre")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _slurm_reachable() -> bool:
    if shutil.which("sinfo") is None:
        return False
    return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=10).returncode == 0


def pytest_collection_modifyitems(config, items):
    need_gpu = any("gpu" in item.keywords for item in items)
    need_slurm = any("slurm" in item.keywords for item in items)
    skip_gpu = need_gpu and not _cuda_available()
    skip_slurm = need_slurm and not _slurm_reachable()
    for item in items:
        if skip_gpu and "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs CUDA; none on this machine"))
        if skip_slurm and "slurm" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs the dev Slurm cluster: run tools/slurm-dev up"))


@pytest.fixture
def reserve_port():
    """Call it for a free port, reserved until the test ends (gyre.common.ports): for a process
    the test starts that binds it by number; nothing listens on it until one does."""
    with contextlib.ExitStack() as held:
        yield lambda: held.enter_context(PortReservation())
