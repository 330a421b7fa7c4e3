"""How many of gyre/'s files one short run crosses: `python tools/probe/files_crossed.py [REPO]`.

Runs `gyre-train num_steps=1 tasks.warm_start=false` from REPO (default: this checkout; give an
older checkout of the same project to compare) with every Python process it starts profiled by
tools/probe/crossed/sitecustomize.py (an older checkout needs `ln -s ../conf gyre/conf`, as its
editable install is not the one that runs), then counts the gyre/ source files in which a function ran
(module-level code, which only imports, does not count), by package. One step is the whole way of
an execution: a harness's calls through the proxy to an engine, records, evaluation, the trajectory,
the core's step, and the weights published to and served by the engines. Last line: one JSON object.
"""

import collections
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gyre.common import jsonio

PROBE = Path(__file__).resolve().parent / "crossed"


def main(repo: Path) -> None:
    out = Path(tempfile.mkdtemp(prefix="gyre-crossed-"))
    env = dict(os.environ, GYRE_CROSSED_DIR=str(out), PYTHONPATH=f"{PROBE}:{repo}", OMP_NUM_THREADS="1")
    overrides = ["num_steps=1", "tasks.warm_start=false", f"hydra.run.dir={out}/run"]
    run = [sys.executable, "-m", "gyre.launch.train", *overrides]
    subprocess.run(run, cwd=repo, env=env, check=True, stdout=subprocess.DEVNULL)
    gyre = str(repo.resolve() / "gyre") + "/"
    files = {line.strip() for f in out.glob("*.txt") for line in f.read_text().splitlines()}
    crossed = sorted(f[len(gyre) :] for f in files if f.startswith(gyre))
    packages = collections.Counter(f.split("/")[0] if "/" in f else "(gyre)" for f in crossed)
    for f in crossed:
        print(f)
    print(f"{len(crossed)} files in {len(packages)} packages: {dict(sorted(packages.items()))}")
    print(jsonio.dumps({"repo": str(repo), "files": len(crossed), "packages": len(packages)}))


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path(__file__).resolve().parents[2])
