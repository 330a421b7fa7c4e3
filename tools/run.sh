#!/usr/bin/env bash
# The main job on the embedded default (local cells, tiny model, CPU): set up, then run.
# Extra arguments are Hydra overrides for gyre-train.
#
# The coordinator that runs the whole loop is not built yet. Until it is, this runs the deepest
# real part that exists end to end: the scheduler policy driven by the cluster simulator
# (gyre-sim, all three modes), and then gyre-train, which validates the config and says plainly
# that it cannot run the job yet (non-zero exit).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh

out=outputs/run-$(date +%Y%m%d-%H%M%S)
echo "== gyre-sim (simulated cluster, real scheduler policy) -> $out/sim" >&2
.venv/bin/gyre-sim hydra.run.dir="$out/sim"

echo "== gyre-train $*" >&2
exec .venv/bin/gyre-train hydra.run.dir="$out/train" "$@"
