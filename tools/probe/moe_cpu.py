"""Does megatron-core's MoE layer run forward + backward on CPU (gloo, local layer spec), with each
token dispatcher? Prints one JSON line. Gyre refuses Qwen3-MoE checkpoints while this says no
(megatron-core 0.16.1: MoELayer makes a torch.cuda.Stream; the allgather dispatcher asserts CUDA).

    .venv/bin/python tools/probe/moe_cpu.py
"""

import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import megatron.core

from gyre.common import jsonio
from gyre.train.model import init_distributed

init_distributed(1, 0)
from megatron.core.models.gpt import GPTModel  # noqa: E402 - megatron's models after its parallel state
from megatron.core.models.gpt import gpt_layer_specs as specs  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

out = {"megatron_core": megatron.core.__version__}
for dispatcher in ("alltoall", "allgather"):
    try:
        cfg = TransformerConfig(
            num_layers=2,
            hidden_size=64,
            ffn_hidden_size=96,
            num_attention_heads=4,
            num_query_groups=2,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            params_dtype=torch.float32,
            use_cpu_initialization=True,
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            qk_layernorm=True,
            num_moe_experts=4,
            moe_router_topk=2,
            moe_ffn_hidden_size=48,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type=dispatcher,
            moe_router_load_balancing_type="none",
        )
        spec = specs.get_gpt_layer_local_spec(
            num_experts=4, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
        )
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=spec,
            vocab_size=64,
            max_sequence_length=128,
            position_embedding_type="rope",
            share_embeddings_and_output_weights=False,
        )
        ids = torch.randint(0, 64, (1, 16))
        pos = torch.arange(16)[None]
        logits = model(ids, pos, attention_mask=None)
        logits.float().sum().backward()
        out[dispatcher] = {
            "ok": True,
            "logits_shape": list(logits.shape),
            "expert_grads": sum(p.grad is not None for n, p in model.named_parameters() if "experts" in n),
        }
    except Exception as e:
        out[dispatcher] = {
            "ok": False,
            "error": f"{type(e).__name__}: {str(e)[:300]}",
            "where": traceback.extract_tb(e.__traceback__)[-1].filename.split("site-packages/")[-1],
        }
print(jsonio.dumps(out))
