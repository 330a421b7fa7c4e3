"""The one place where megatron-core is taught to run without CUDA (CPU tests, laptops).

megatron-core 0.16.1 asks `torch.cuda` for the current device and synchronises streams in code paths
that are otherwise device-agnostic. Without CUDA we answer "cpu" and make synchronisation a no-op;
RNG tracking uses the inference tracker (plain torch RNG), and the model is built with
`use_cpu_initialization`, the local layer spec, fp32 and a plain torch optimizer (see
gyre/train/model.py). `apply_cpu_shim` does nothing when CUDA is available, so GPU runs use the
unmodified library.
"""

import sys

import torch

_applied = False


def apply_cpu_shim() -> bool:
    """Patch `torch.cuda` entry points megatron-core calls, once, only when CUDA is absent; imports
    megatron-core then (without its jit fuser) if nothing has yet: call it before importing it.

    Returns:
        True if the shim is active (no CUDA), False on a CUDA machine.
    """
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        _import_megatron_without_jit_fuser()
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *args, **kwargs: None
        _applied = True
    return True


def _import_megatron_without_jit_fuser() -> None:
    """Import megatron-core with its jit fuser off (`megatron.core.jit.disable_jit_fuser`, which
    only takes effect on modules imported after it).

    megatron-core wraps its fused kernels in `torch.compile` as their modules load, and the first
    `torch.compile` imports TorchInductor: ~2.6 s of CPU in every trainer process here, for
    kernels a CPU run never calls (gyre/train/model.py turns the fusions off without CUDA).
    """
    if "megatron.core" in sys.modules:
        return

    def uncompiled(model=None, **_):
        return model if model is not None else (lambda fn: fn)

    compile_ = torch.compile
    torch.compile = uncompiled
    try:
        from megatron.core import jit
    finally:
        torch.compile = compile_
    jit.disable_jit_fuser()
