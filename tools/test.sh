#!/usr/bin/env bash
# The test command: set up from nothing (venv, packages, the local Slurm cluster), run the whole
# pytest suite, stop the cluster, and exit with pytest's status. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

start=$SECONDS
tools/setup.sh
tools/slurm-dev up
echo "test.sh: set-up took $((SECONDS - start)) s" >&2
eval "$(tools/slurm-dev env)"

rc=0
OMP_NUM_THREADS=1 .venv/bin/python -m pytest "$@" || rc=$?
tools/slurm-dev down
echo "test.sh: total $((SECONDS - start)) s, pytest exit status $rc" >&2
exit $rc
