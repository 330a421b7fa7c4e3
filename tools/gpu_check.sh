#!/usr/bin/env bash
# GPU acceptance check, one H100 (or H200), prints one JSON line {"parity": ..., "elastic": ..., "ok": ...}:
# 1. parity (issue 17, tools/gpu_check.py): trainer (megatron-core, bf16, NCCL, 1 GPU) and the builtin
#    engine's forward on CUDA against `transformers`, one RL step and a weight hand-off; and
#    (issue 41) the same fp32 train step on CUDA and on CPU (log-probs within 1e-3, grad norm within
#    1e-4 relative), gyre-plan's memory plan against torch.cuda.memory_allocated for the same Qwen3
#    shape, and the trainer's offload/onload around a role switch (memory freed and back, weights
#    bit for bit).
# 2. elastic (issue 26): a 2-step elastic `gyre-train` on local cells, the megatron-core trainer on
#    CUDA in every cell; SGLang engines (contract-checked flags, weights by
#    update_weights_from_distributed over NCCL, --skip-tokenizer-init: Gyre sends token ids) where
#    `sglang` imports, else the builtin engine (its engine thread computes on CPU).
# Bounded by 8 minutes (210 s + 240 s of timeouts, and the probe): a part that overruns reports no
# result and `ok` is false.
#
# The GPU machine seen so far has Python 3.12 with CUDA torch and transformers, but no registry and
# no megatron-core: carry megatron-core's pure-Python package with the tree, prepared here with
#   mkdir -p build/gpu && cp -r /work/main/.venv/lib/python3.11/site-packages/megatron build/gpu/
# (17 MB; its one compiled module, the datasets helper, is never imported), then run this script
# with `build/gpu` carried. Step 2 also needs Gyre's runtime dependencies (hydra-core, aiohttp,
# aiohttp-sse, orjson, safetensors, openai, and a Mooncake wheel whose TransferEngine registers the
# trainer's CUDA buffers) importable there; it is skipped, and says so, where they are not.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/build/gpu${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch, transformers, megatron.core; assert torch.cuda.is_available(); print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" >&2
out=$(mktemp -d)
RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 timeout 210 python tools/gpu_check.py > "$out/parity.json" || true

elastic() {
  python -c "import hydra, aiohttp, aiohttp_sse, orjson, safetensors, openai, mooncake" 2>"$out/missing.txt" || {
    python -c "import json,sys; print(json.dumps({'skipped': open(sys.argv[1]).read().strip().splitlines()[-1]}))" "$out/missing.txt"
    return
  }
  local engine=(engine=builtin)
  if python -c "import sglang" 2>/dev/null; then
    python -c "
from gyre.models.checkpoint import save_checkpoint
from gyre.models.config import ModelConfig
from gyre.models.transformer import init_weights
m = ModelConfig(name='tiny', num_layers=2, hidden_size=128, ffn_hidden_size=384, vocab_size=512)
save_checkpoint('$out/tiny', m, init_weights(m, 0))"
    engine=(engine=sglang "engine.model_path=$out/tiny" engine.load_format=dummy engine.host=127.0.0.1
      engine.enable_hicache=false engine.mooncake_master= engine.mem_fraction_static=0.15
      'engine.extra_args=["--skip-tokenizer-init","--disable-cuda-graph"]')
  fi
  timeout 240 python -m gyre.launch.train "hydra.run.dir=$out/run" num_steps=2 cluster.num_cells=3 \
    coordinator.cpus_per_cell=4 coordinator.group_size=2 coordinator.groups_per_step=3 \
    harness.toy.max_tokens=16 harness.toy.max_turns=2 tasks.warm_start=false "${engine[@]}" \
    > "$out/elastic.log" 2>&1 || true
  python - "$out/elastic.log" "${engine[0]}" <<'PY'
import json, sys
lines = open(sys.argv[1]).read().splitlines()
try:
    summary = json.loads(lines[-1])
except (IndexError, json.JSONDecodeError):
    print(json.dumps({"engine": sys.argv[2], "failed": "\n".join(lines[-15:])}))
else:
    print(json.dumps({"engine": sys.argv[2], "num_steps": summary.get("num_steps"), "executions": summary.get("executions"),
                      "num_role_switches": summary.get("num_role_switches"), "ok": summary.get("num_steps") == 2}))
PY
}
elastic > "$out/elastic.json"
python - "$out/parity.json" "$out/elastic.json" <<'PY'
import json, sys
parity, elastic = (json.loads(open(p).read() or "{}") for p in sys.argv[1:])
print(json.dumps({"parity": parity, "elastic": elastic, "ok": bool(parity.get("ok")) and bool(elastic.get("ok"))}))
PY
