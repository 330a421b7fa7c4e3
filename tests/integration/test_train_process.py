"""What a trainer process pays to start: megatron-core's import on CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
from gyre.train.cpu_shim import apply_cpu_shim
apply_cpu_shim()
from megatron.core import jit
from megatron.core.fusions import fused_bias_swiglu
import megatron.core.models.gpt, megatron.core.optimizer
print(json.dumps({
    "inductor": "torch._inductor.compile_fx" in sys.modules,
    "fuser": jit.jit_fuser.__name__,
    "compiled": hasattr(fused_bias_swiglu.bias_swiglu, "_torchdynamo_orig_callable"),
}))
"""


def test_on_cpu_megatron_imports_without_its_jit_fuser_or_torchinductor():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe == {"inductor": False, "fuser": "noop_decorator", "compiled": False}
