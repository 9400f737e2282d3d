"""``zoo::fp8_block_linear``: ``x W^T + b`` with an FP8 block-scaled weight (``ops_cuda/fp8.py``).

Its reference (the CPU path and the test oracle) dequantises the weight to the activation dtype and
multiplies: exactly what a checkpoint dequantised on load computes. On the GPU a single row takes that
product itself in a matrix-vector kernel; more rows have their activations quantised per token and
group and multiply FP8 operands (``ops_cuda/fp8_triton.py``).
"""

import torch
import torch.nn.functional as F

from ops_cuda.dispatch import cuda_implementation, public_op
from ops_cuda.fp8 import check_block_weight, dequantise


def fp8_block_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: list[int], bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., K] times the FP8 weight [N, K] (``scale_inv`` [ceil(N / block[0]), ceil(K / block[1])])
    dequantised to x's dtype, plus ``bias``: [..., N]."""
    _check(x, weight, scale_inv, block)
    return F.linear(x, dequantise(weight, scale_inv, block).to(x.dtype), bias)


def _check(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block) -> None:
    # Before any kernel: a row of another width would be read against the weight's columns.
    check_block_weight("fp8_block_linear", weight, scale_inv, block)
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"zoo::fp8_block_linear: x of shape {tuple(x.shape)} for a weight of shape "
                         f"{tuple(weight.shape)}: its last dimension must be the weight's {weight.shape[-1]} columns")


fp8_block_linear_op = torch.library.custom_op("zoo::fp8_block_linear", fp8_block_linear_reference, mutates_args=())


@fp8_block_linear_op.register_fake
def _(x, weight, scale_inv, block, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@cuda_implementation(fp8_block_linear_op)
def _(x, weight, scale_inv, block, bias):
    # triton is imported only where a kernel runs
    from ops_cuda.fp8_triton import (
        cuda_kernel,
        fp8_block_gemm_scaled_mm,
        fp8_block_gemm_triton,
        fp8_block_gemv_triton,
    )

    _check(x, weight, scale_inv, block)
    kernel = cuda_kernel(x, weight, block)
    if kernel == "reference":  # other dtypes or blocks, GPUs without FP8 tensor cores
        return fp8_block_linear_reference(x, weight, scale_inv, block, bias)
    if kernel == "gemv":
        return fp8_block_gemv_triton(x, weight, scale_inv, block, bias).view(*x.shape[:-1], weight.shape[0])
    rows = x.reshape(-1, x.shape[-1])
    if kernel == "scaled_mm":
        out = fp8_block_gemm_scaled_mm(rows, weight, scale_inv, bias)
    else:
        out = fp8_block_gemm_triton(rows, weight, scale_inv, block, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


fp8_block_linear = public_op(fp8_block_linear_op, fp8_block_linear_reference)
