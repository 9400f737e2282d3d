"""The ops as layers call them.

On CPU tensors each one runs its PyTorch reference directly; on any other device (CUDA, and the
fake tensors of tracing) it goes through its ``torch.library`` op, whose CUDA kernel is Triton.
The op's default kernel is that same reference, so CPU results are unchanged: what the CPU skips
is the custom op's Python dispatch, tens of µs a call, which made SmolLM2's CPU decode step (16
sequences) 6% slower, measured by alternating the two ways within one process.

When torch.compile traces a CPU model (``LLM(..., compile_decode=True)``), the references are traced
too, so that inductor fuses their ops, except MoE's, which reads its group sizes on the host: it
stays its opaque op, whose CPU kernel runs the reference.
"""

import torch
import torch.nn.functional as F

from ops_cuda import activation, kv_cache, moe, norm, rotary
from ops_cuda.argmax import argmax as argmax_op, argmax_reference
from ops_cuda.gemv import GEMV_DTYPES, gemv


def _reference_on_cpu(op, reference, reads_host=False):
    def call(*args, **kwargs):
        direct = args[0].device.type == "cpu" and not (reads_host and torch.compiler.is_compiling())
        return (reference if direct else op)(*args, **kwargs)

    call.__name__, call.__doc__ = reference.__name__.removesuffix("_reference"), op.__doc__
    return call


rms_norm = _reference_on_cpu(norm.rms_norm, norm.rms_norm_reference)
fused_add_rms_norm = _reference_on_cpu(norm.fused_add_rms_norm, norm.fused_add_rms_norm_reference)
apply_rotary = _reference_on_cpu(rotary.apply_rotary, rotary.apply_rotary_reference)
act_and_mul = _reference_on_cpu(activation.act_and_mul, activation.act_and_mul_reference)
write_kv_cache = _reference_on_cpu(kv_cache.write_kv_cache, kv_cache.write_kv_cache_reference)
moe_experts = _reference_on_cpu(moe.moe_experts, moe.moe_experts_reference, reads_host=True)
argmax = _reference_on_cpu(argmax_op, argmax_reference)


class PackedWeight:
    """A CPU weight [out, in] packed once for the few rows of a decode step: float32 by MKL,
    bfloat16 by oneDNN.

    ``F.linear`` has the library pack the weight anew on every call; a weight packed once is read
    as it is. The packed layout suits a number of rows: packed for 16, SmolLM2's float32 products
    run 1.2-1.7x faster than with ``F.linear`` at 8 to 16 rows, as fast at 1, and slower at 48 and
    more (``benchmarks/bench_cpu_linear.py``), so steps of more rows (prompt chunks, wide batches)
    keep ``F.linear``. Up to 16 rows the bfloat16 products equal ``F.linear``'s bit for bit. The
    pack is a copy: it stands for the weight only while that is unchanged, and it costs the
    weight's memory again.
    """

    ROWS = 16

    def __init__(self, weight: torch.Tensor):
        if weight.dtype == torch.float32:
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, self.ROWS)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.ROWS)
        self.source = self._identity(weight)

    @staticmethod
    def _identity(weight: torch.Tensor) -> tuple:
        # Storage and version counter: writing into the weight in place bumps the version. (A
        # tensor made under inference_mode keeps no version; only its storage is checked.)
        return weight.data_ptr(), None if weight.is_inference() else weight._version

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        if weight.device.type != "cpu":
            return False
        if weight.dtype == torch.float32:
            return torch.backends.mkl.is_available()
        return (weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())

    def serves(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return x.numel() <= self.ROWS * x.shape[-1] and self._identity(weight) == self.source

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if weight.dtype == torch.float32:
            out = torch.ops.mkl._mkl_linear(rows, self.packed, weight, bias, rows.shape[0])
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    def __reduce__(self):
        # A copy or a pickle of the model leaves the pack behind (MKL's layout can be neither
        # copied nor saved): the copy multiplies by its own weights unpacked.
        return _no_pack, ()


def _no_pack() -> None:
    return None


def linear(x, weight, bias=None, packed: PackedWeight | None = None):
    """``F.linear``; on the GPU a single float16/bfloat16 row goes to zoo::gemv, when the weight's
    rows are contiguous (a CPU-loaded model moved to the GPU keeps its column-major weights). On
    the CPU, ``packed`` (the weight's ``PackedWeight``, if the runtime made one) serves few rows,
    except in a graph torch.compile traces, where inductor packs the weights itself."""
    if packed is not None and x.device.type == "cpu" and not torch.compiler.is_compiling() and packed.serves(x, weight):
        return packed.linear(x, weight, bias)
    if x.device.type == "cuda" and x.numel() == x.shape[-1] and x.dtype in GEMV_DTYPES and weight.stride(-1) == 1:
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
