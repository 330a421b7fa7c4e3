#!/usr/bin/env bash
# GPU acceptance check for HF checkpoints (issue 17): trainer (megatron-core, bf16, NCCL, 1 GPU) and
# the builtin engine on CUDA against `transformers`, one RL step and a weight push; prints one JSON
# line (tools/gpu_check.py says what is checked and the bf16 tolerance). Sized for one 10-minute
# run on one H200 (about 2 minutes of work; the rest is margin for imports and CUDA start-up).
#
# The GPU machine has Python 3.12 with CUDA torch and transformers, but no registry and no
# megatron-core: carry megatron-core's pure-Python package with the tree, prepared here with
#   mkdir -p build/gpu && cp -r /work/main/.venv/lib/python3.11/site-packages/megatron build/gpu/
# (17 MB; its one compiled module, the datasets helper, is never imported), then run this script
# with `build/gpu` carried. SGLang is not needed and not available there.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/build/gpu${PYTHONPATH:+:$PYTHONPATH}"
export RANK=0 WORLD_SIZE=1 LOCAL_RANK=0
python -c "import torch, transformers, megatron.core; assert torch.cuda.is_available(); print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" >&2
exec timeout 540 python tools/gpu_check.py
