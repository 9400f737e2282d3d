"""A linear layer's product on a single row: the matmuls of batch-1 decode.

Each weight element is used once, so the product is a stream of the weight from memory. On the
GPU a Triton kernel streams it faster than cuBLAS's kernels for the Llama-3.1-8B decode shapes
(benchmarks/bench_gemv.py); ``ops_cuda.linear.linear`` sends single float16/bfloat16 rows here
and everything else to ``F.linear``. ``gated_gemv`` is the product of a gated MLP's down projection,
with the activation computed as the kernel reads its input; ``fused_add_rms_norm_gemv`` the product
of a projection that a pre-norm feeds, with the residual add and the norm computed likewise.
"""

import torch
import torch.nn.functional as F

from ops_cuda.activation import act_and_mul_reference
from ops_cuda.dispatch import reference_on_cpu
from ops_cuda.norm import fused_add_rms_norm_reference

GEMV_DTYPES = (torch.float16, torch.bfloat16)


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b for x [..., K] holding one row and W [N, K]."""
    return F.linear(x, weight, bias)


@torch.library.custom_op("zoo::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return gemv_reference(x, weight, bias)


@gemv_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@gemv_op.register_kernel("cuda")
def _(x, weight, bias):
    from ops_cuda.triton_kernels import gemv_triton  # triton is imported only where a kernel runs

    return gemv_triton(x, weight, bias)


gemv = reference_on_cpu(gemv_op, gemv_reference)


def gated_gemv_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str
) -> torch.Tensor:
    """act(gate) * up times W^T, plus b, for x [..., 2K] holding one row of gate then up and W [N, K]:
    ``act_and_mul`` then ``gemv``, which the CUDA kernel computes in one launch (a gated MLP's down
    projection reads gate_up's output directly)."""
    return gemv_reference(act_and_mul_reference(x, activation), weight, bias)


@torch.library.custom_op("zoo::gated_gemv", mutates_args=())
def gated_gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    return gated_gemv_reference(x, weight, bias, activation)


@gated_gemv_op.register_fake
def _(x, weight, bias, activation):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@gated_gemv_op.register_kernel("cuda")
def _(x, weight, bias, activation):
    from ops_cuda.triton_kernels import gated_gemv_triton  # triton is imported only where a kernel runs

    return gated_gemv_triton(x, weight, bias, activation)


gated_gemv = reference_on_cpu(gated_gemv_op, gated_gemv_reference)


def fused_add_rms_norm_gemv_reference(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight_offset: float,
    multiply_in_float32: bool, weight: torch.Tensor, bias: torch.Tensor | None, summed: torch.Tensor,
) -> torch.Tensor:
    """rms_norm(x + residual) W^T + b for one row x [..., K] and W [N, K], writing x + residual
    into ``summed``: ``fused_add_rms_norm`` (with its options) then ``gemv``, which the CUDA kernel
    computes in one launch (a decoder layer's pre-norm folded into the projection that reads it)."""
    normed, total = fused_add_rms_norm_reference(x, residual, norm_weight, eps, weight_offset, multiply_in_float32)
    summed.copy_(total)
    return gemv_reference(normed, weight, bias)


@torch.library.custom_op("zoo::fused_add_rms_norm_gemv", mutates_args=("summed",))
def fused_add_rms_norm_gemv_op(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight_offset: float,
    multiply_in_float32: bool, weight: torch.Tensor, bias: torch.Tensor | None, summed: torch.Tensor,
) -> torch.Tensor:
    return fused_add_rms_norm_gemv_reference(
        x, residual, norm_weight, eps, weight_offset, multiply_in_float32, weight, bias, summed
    )


@fused_add_rms_norm_gemv_op.register_fake
def _(x, residual, norm_weight, eps, weight_offset, multiply_in_float32, weight, bias, summed):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@fused_add_rms_norm_gemv_op.register_kernel("cuda")
def _(x, residual, norm_weight, eps, weight_offset, multiply_in_float32, weight, bias, summed):
    from ops_cuda.triton_kernels import fused_add_rms_norm_gemv_triton  # triton is imported only where a kernel runs

    return fused_add_rms_norm_gemv_triton(
        x, residual, norm_weight, eps, weight_offset, multiply_in_float32, weight, bias, summed
    )


fused_add_rms_norm_gemv = reference_on_cpu(fused_add_rms_norm_gemv_op, fused_add_rms_norm_gemv_reference)
