#!/usr/bin/env bash
# The test command: set up from nothing (venv, packages, the local Slurm cluster), run the whole
# pytest suite, stop the cluster, and exit with pytest's status. Extra arguments go to one pytest run instead.
set -euo pipefail
cd "$(dirname "$0")/.."

start=$SECONDS
tools/setup.sh
tools/slurm-dev up
echo "test.sh: set-up took $((SECONDS - start)) s" >&2
eval "$(tools/slurm-dev env)"

# Without arguments: the unit tests on two workers (pure cores and in-process parts, robust to a
# loaded box); the integration tests that start a server or a short process, also on two workers
# (they mostly wait on sockets and child processes: 191 s against 294 s one at a time); then the
# `slow` and `slurm` ones one at a time (whole runs under CPU quotas, timed budgets, Slurm jobs).
rc=0
# Style first: the formatter and the linter as configured in pyproject.toml (a failure fails the run).
.venv/bin/ruff format --check --quiet . || rc=1
.venv/bin/ruff check --quiet . || rc=1
pytest() { OMP_NUM_THREADS=1 .venv/bin/python -m pytest "$@" || rc=$?; }
if (($#)); then
  pytest "$@"
else
  pytest -n 2 --durations=15 tests/unit
  pytest -n 2 --durations=15 -m "not slow and not slurm" tests/integration
  pytest --durations=15 -m "slow or slurm" tests/integration
fi
tools/slurm-dev down
echo "test.sh: total $((SECONDS - start)) s, pytest exit status $rc" >&2
exit $rc
