"""A linear layer's product on a single row: the matmuls of batch-1 decode.

Each weight element is used once, so the product is a stream of the weight from memory. On the
GPU a Triton kernel streams it faster than cuBLAS's kernels for the Llama-3.1-8B decode shapes
(benchmarks/bench_gemv.py); ``ops_cuda.linear.linear`` sends single float16/bfloat16 rows here
and everything else to ``F.linear``.
"""

import torch
import torch.nn.functional as F

from ops_cuda.dispatch import reference_on_cpu

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
