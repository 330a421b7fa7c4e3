"""The one place where megatron-core is taught to run without CUDA (CPU tests, laptops).

megatron-core 0.16.1 asks `torch.cuda` for the current device and synchronises streams in code paths
that are otherwise device-agnostic. Without CUDA we answer "cpu" and make synchronisation a no-op;
RNG tracking uses the inference tracker (plain torch RNG), and the model is built with
`use_cpu_initialization`, the local layer spec, fp32 and a plain torch optimizer (see
gyre/train/model.py). `apply_cpu_shim` does nothing when CUDA is available, so GPU runs use the
unmodified library.
"""

import torch

_applied = False


def apply_cpu_shim() -> bool:
    """Patch `torch.cuda` entry points megatron-core calls, once, only when CUDA is absent.

    Returns:
        True if the shim is active (no CUDA), False on a CUDA machine.
    """
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *args, **kwargs: None
        _applied = True
    return True
