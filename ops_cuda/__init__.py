"""GPU ops behind zoo's layers.

Each op is a ``torch.library`` custom op in the ``zoo`` namespace. Its default kernel is a
pure-PyTorch reference (used on CPU and as the test oracle); GPU kernels register for the
``cuda`` dispatch key on top of it. The Triton kernels of the elementwise ops (norms, rotary,
gated activations, KV-cache write, single-row matmul, argmax) live in ``ops_cuda.triton_kernels``, imported only when a CUDA
kernel first runs: ``import ops_cuda`` never imports triton. Layers call the ops through
``ops_cuda.calls``, which runs the references directly on CPU tensors.
"""

from ops_cuda.activation import ACTIVATIONS, act_and_mul
from ops_cuda.argmax import argmax
from ops_cuda.gemv import gemv
from ops_cuda.kv_cache import write_kv_cache
from ops_cuda.moe import moe_experts
from ops_cuda.norm import fused_add_rms_norm, rms_norm
from ops_cuda.paged_attention import paged_decode_attention, paged_prefill_attention
from ops_cuda.rotary import apply_rotary

__all__ = [
    "ACTIVATIONS", "act_and_mul", "apply_rotary", "argmax", "fused_add_rms_norm", "gemv", "moe_experts", "paged_decode_attention",
    "paged_prefill_attention", "rms_norm", "write_kv_cache",
]
