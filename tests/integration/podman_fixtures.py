"""The local image container tests run Harbor tasks in (tools/podman-test-image: debootstrap, podman import)."""

import functools
import subprocess
from pathlib import Path

from gyre.harness.podman import podman_available

ROOT = Path(__file__).resolve().parents[2]
IMAGE_SET = ROOT / "tests" / "harbor_image_tasks"


@functools.cache
def local_image() -> tuple[str | None, str]:
    """(the test image's name, '') once it is in podman's store, else (None, why not)."""
    if not podman_available():
        return None, "podman cannot run here (apt-get install podman runc; tools/setup.sh)"
    done = subprocess.run([ROOT / "tools" / "podman-test-image"], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        return None, f"tools/podman-test-image failed: {done.stderr.strip()[-300:]}"
    return done.stdout.strip(), ""
