#!/usr/bin/env bash
# The main job on the embedded default (local cells, tiny model, CPU): set up, then run.
# Extra arguments are Hydra overrides for gyre-train.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
exec .venv/bin/gyre-train "$@"
