"""A linear layer's product on a single row: the matmuls of batch-1 decode.

Each weight element is used once, so the product is a stream of the weight from memory. On the
GPU a Triton kernel streams it faster than cuBLAS's kernels for the Llama-3.1-8B decode shapes
(benchmarks/bench_gemv.py); ``ops_cuda.linear.linear`` sends single float16/bfloat16 rows here
and everything else to ``F.linear``. With ``out_dtype=torch.float32`` the product is the float32
one of the widened operands (a router's logits, as HF takes them) without a float32 copy of the weight.

A gated MLP's gate_up product on a single row is ``zoo::gated_gemv``: its kernel computes
act(gate x) * up x straight from the weight's gate and up rows, so the activation takes no launch
of its own and the [2I] product is never written.
"""

import torch
import torch.nn.functional as F

from ops_cuda.activation import act_and_mul_reference
from ops_cuda.dispatch import cuda_implementation, public_op

GEMV_DTYPES = (torch.float16, torch.bfloat16)


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x W^T + b for x [..., K] holding one row and W [N, K], in ``out_dtype`` (default: x's)."""
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, weight, bias)
    return F.linear(x.to(out_dtype), weight.to(out_dtype), None if bias is None else bias.to(out_dtype))


@torch.library.custom_op("zoo::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return gemv_reference(x, weight, bias, out_dtype)


@gemv_op.register_fake
def _(x, weight, bias, out_dtype=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=out_dtype or x.dtype)


@cuda_implementation(gemv_op)
def _(x, weight, bias, out_dtype=None):
    from ops_cuda.triton_kernels import gemv_triton  # triton is imported only where a kernel runs

    return gemv_triton(x, weight, bias, out_dtype)


gemv = public_op(gemv_op, gemv_reference)


def gated_gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str) -> torch.Tensor:
    """act(gate) * up of x W^T + b for x [..., K] holding one row and W [2I, K] holding I gate rows then I up
    rows (b [2I] likewise): h [..., I]; ``activation`` is a key of ``ops_cuda.GATED_ACTIVATIONS``."""
    return act_and_mul_reference(gemv_reference(x, weight, bias), activation)


@torch.library.custom_op("zoo::gated_gemv", mutates_args=())
def gated_gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    return gated_gemv_reference(x, weight, bias, activation)


@gated_gemv_op.register_fake
def _(x, weight, bias, activation):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)


@cuda_implementation(gated_gemv_op)
def _(x, weight, bias, activation):
    from ops_cuda.triton_kernels import gated_gemv_triton  # triton is imported only where a kernel runs

    return gated_gemv_triton(x, weight, bias, activation)


gated_gemv = public_op(gated_gemv_op, gated_gemv_reference)
