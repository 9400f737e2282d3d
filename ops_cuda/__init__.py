"""GPU ops behind zoo's layers.

Each op is a ``torch.library`` custom op in the ``zoo`` namespace (``torch.ops.zoo.<name>``; in its
file, ``<name>_op``). Its default kernel is a pure-PyTorch reference (``<name>_reference``, used on
CPU and as the test oracle); GPU kernels register for the ``cuda`` dispatch key on top of it
(Triton's, or PyTorch's flash attention for ``prompt_attention``). The name exported here calls
the reference on CPU tensors and the CUDA kernel on CUDA tensors directly, and the custom op while
torch.compile traces and on meta tensors (``ops_cuda.dispatch``). The Triton kernels live in
``triton_kernels`` (norms, rotary, gated activations, KV-cache write, q/k-norm with rotary and the
KV-cache write in one kernel, single-row matmuls, plain, with the gated activation and on either side
of a split RMSNorm, argmax),
``paged_attention_triton``, ``mla_attention_triton``, ``moe_triton``, ``moe_decode``,
``moe_grouped_mm``, ``router_triton`` and ``fp8_triton`` (block-scaled FP8 GEMM), imported only when
a CUDA kernel first runs: ``import ops_cuda`` never imports triton. ``ops_cuda.linear`` routes
linear layers' products (packed CPU weights, zoo::gemv, zoo::gated_gemv).
"""

from ops_cuda.activation import ACTIVATIONS, GATED_ACTIVATIONS, act_and_mul
from ops_cuda.argmax import argmax
from ops_cuda.fp8_linear import fp8_block_linear
from ops_cuda.gemv import gated_gemv, gemv, gemv_into_norm, normed_gated_gemv, normed_gemv
from ops_cuda.kv_cache import write_kv_cache
from ops_cuda.mla_attention import mla_decode_attention, mla_prefill_attention
from ops_cuda.moe import (fp8_moe_experts, moe_experts, mxfp4_moe_experts, normed_moe_experts,
                          normed_moe_experts_into_norm)
from ops_cuda.norm import fused_add_rms_norm, rms_norm
from ops_cuda.paged_attention import paged_decode_attention, paged_prefill_attention
from ops_cuda.prompt_attention import prompt_attention
from ops_cuda.rotary import apply_rotary
from ops_cuda.rotary_kv import rotary_write_kv
from ops_cuda.router import route_topk

__all__ = [
    "ACTIVATIONS", "GATED_ACTIVATIONS", "act_and_mul", "apply_rotary", "argmax", "fp8_block_linear", "fp8_moe_experts",
    "fused_add_rms_norm", "gated_gemv", "gemv", "gemv_into_norm", "mla_decode_attention", "mla_prefill_attention",
    "moe_experts", "mxfp4_moe_experts", "normed_gated_gemv", "normed_gemv", "normed_moe_experts",
    "normed_moe_experts_into_norm", "paged_decode_attention", "paged_prefill_attention", "prompt_attention", "rms_norm",
    "rotary_write_kv", "route_topk", "write_kv_cache",
]
