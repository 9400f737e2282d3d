"""The ops as layers call them.

On CPU tensors each one runs its PyTorch reference directly; on any other device (CUDA, and the
fake tensors of tracing) it goes through its ``torch.library`` op, whose CUDA kernel is Triton.
The op's default kernel is that same reference, so CPU results are unchanged: what the CPU skips
is the custom op's Python dispatch, tens of µs a call, which made SmolLM2's CPU decode step (16
sequences) 6% slower, measured by alternating the two ways within one process.
"""

import torch.nn.functional as F

from ops_cuda import activation, kv_cache, moe, norm, rotary
from ops_cuda.argmax import argmax as argmax_op, argmax_reference
from ops_cuda.gemv import GEMV_DTYPES, gemv


def _reference_on_cpu(op, reference):
    def call(*args, **kwargs):
        return (reference if args[0].device.type == "cpu" else op)(*args, **kwargs)

    call.__name__, call.__doc__ = reference.__name__.removesuffix("_reference"), op.__doc__
    return call


rms_norm = _reference_on_cpu(norm.rms_norm, norm.rms_norm_reference)
fused_add_rms_norm = _reference_on_cpu(norm.fused_add_rms_norm, norm.fused_add_rms_norm_reference)
apply_rotary = _reference_on_cpu(rotary.apply_rotary, rotary.apply_rotary_reference)
act_and_mul = _reference_on_cpu(activation.act_and_mul, activation.act_and_mul_reference)
write_kv_cache = _reference_on_cpu(kv_cache.write_kv_cache, kv_cache.write_kv_cache_reference)
moe_experts = _reference_on_cpu(moe.moe_experts, moe.moe_experts_reference)
argmax = _reference_on_cpu(argmax_op, argmax_reference)


def linear(x, weight, bias=None):
    """``F.linear``; on the GPU a single float16/bfloat16 row goes to zoo::gemv, when the weight's
    rows are contiguous (a CPU-loaded model moved to the GPU keeps its column-major weights)."""
    if x.device.type == "cuda" and x.numel() == x.shape[-1] and x.dtype in GEMV_DTYPES and weight.stride(-1) == 1:
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
