#!/usr/bin/env bash
# The main job on the embedded default: set up, then one elastic RL run on this machine — local
# cells (1 core + 2 satellites, each under a CPU quota), the tiny model warm-started on the toy
# task set, the toy agent in sandboxes, the proxy, the builtin engines. Extra arguments are Hydra
# overrides for gyre-train (e.g. scheduler=colocate num_steps=4). The run directory is printed;
# the last line is the run's summary as one JSON object.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh

out=outputs/run-$(date +%Y%m%d-%H%M%S)
echo "== gyre-train $* -> $out" >&2
exec .venv/bin/gyre-train hydra.run.dir="$out" "$@"
