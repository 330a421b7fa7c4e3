#!/usr/bin/env bash
# Resolver-only check that Gyre's requirements and its `gpu` extra (the pinned torch / sglang /
# mooncake / megatron-core set, CUDA 13) resolve together for Python 3.11 on Linux x86_64: pip
# resolves the set against the package index and installs nothing (pip install --dry-run --report).
#
#   tools/check_gpu_deps.sh [OUT_DIR]     # a few minutes; needs the package index, not a GPU
#
# SGLang's own requirement `cuda-tile` is a stub source package on the index whose build downloads
# its wheel from NVIDIA's index: it cannot be resolved where only the package index is reachable,
# so it is checked by name and pin only and every other requirement of sglang's wheel is resolved
# (listed in OUT_DIR/requirements.txt). Site settings that point pip at local wheels (a CPU torch)
# are left out, so the index's CUDA builds are the ones resolved. Docs: docs/proxy-and-engines.md.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d -t gyre-gpu-deps.XXXX)}
mkdir -p "$out"
python=${PYTHON:-python3}
export PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS="" PIP_CONSTRAINT="" PIP_DISABLE_PIP_VERSION_CHECK=1

sglang_pin=$("$python" -c '
import tomllib
gpu = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"]
print(next(r for r in gpu if r.startswith("sglang")))')
echo "== sglang's wheel ($sglang_pin): its declared requirements"
"$python" -m pip download --quiet --no-deps --only-binary=:all: -d "$out/wheel" "$sglang_pin"

"$python" - "$out" <<'EOF'
"""Write OUT/requirements.txt: Gyre's requirements, its gpu extra less sglang, and sglang's own
requirements less the stubs that only NVIDIA's index serves."""
import glob
import json
import sys
import tomllib
import zipfile

from pip._vendor.packaging.requirements import Requirement

STUBS = {"cuda-tile": "a stub sdist here; its wheel is on NVIDIA's index"}
out = sys.argv[1]
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
gyre = project["dependencies"] + [r for r in project["optional-dependencies"]["gpu"] if not r.startswith("sglang")]
(wheel,) = glob.glob(f"{out}/wheel/sglang-*.whl")
with zipfile.ZipFile(wheel) as z:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
wanted, stubbed = [], {}
for line in meta.splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line.removeprefix("Requires-Dist: "))
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name in STUBS:
        print(f"   not resolved: {req} ({STUBS[req.name]})")
        stubbed[req.name] = str(req.specifier)
        continue
    wanted.append(str(req))
print(f"   {len(wanted)} of sglang's requirements resolved with Gyre's {len(gyre)}")
open(f"{out}/requirements.txt", "w").write("\n".join(gyre + wanted) + "\n")
json.dump(stubbed, open(f"{out}/stubs.json", "w"))
EOF

echo "== resolving (pip install --dry-run --ignore-installed)"
"$python" -m pip install --quiet --dry-run --ignore-installed --only-binary=torch \
    --report "$out/report.json" -r "$out/requirements.txt"

"$python" - "$out" <<'EOF'
"""Print what resolved: the pinned set, the CUDA it brings, and the count; fail if a stubbed pin of
sglang's is outside what the resolved packages ask of that package."""
import json
import sys

from pip._vendor.packaging.requirements import Requirement

report = json.load(open(f"{sys.argv[1]}/report.json"))
got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
for name in ("torch", "megatron-core", "mooncake-transfer-engine-cuda13", "flashinfer-python", "sglang-kernel",
             "torchaudio", "transformers", "nvidia-nccl-cu13", "nvidia-cuda-runtime"):
    print(f"   {name:34} {got.get(name, '-')}")
for name, pin in json.load(open(f"{sys.argv[1]}/stubs.json")).items():
    version = pin.removeprefix("==")
    for item in report["install"]:
        for dep in map(Requirement, item["metadata"].get("requires_dist") or []):
            if dep.name == name and (dep.marker is None or dep.marker.evaluate({"extra": ""})):
                ok = dep.specifier.contains(version, prereleases=True)
                print(f"   {name}{pin} against {item['metadata']['name']}'s {dep.specifier}: {'ok' if ok else 'CONFLICT'}")
                if not ok:
                    sys.exit(1)
print(f"== resolved: {len(got)} packages, CUDA 13 ({sum('cu13' in n for n in got)} *-cu13 packages); "
      f"report {sys.argv[1]}/report.json")
EOF
