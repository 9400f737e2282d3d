"""RMSNorm, alone and with the residual add of the previous sub-block fused in."""

import torch
import torch.nn.functional as F

from ops_cuda.dispatch import cuda_implementation, public_op


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0, multiply_in_float32: bool = False
) -> torch.Tensor:
    """RMSNorm over the last dim of x ([N, H], or [N, heads, head_dim] for q/k-norm), times
    ``weight_offset + weight``. The statistics are float32; HuggingFace's Llama casts them back to
    the input dtype before the weight multiply, its Gemma and OLMo 2 multiply in float32 and cast
    the product (``multiply_in_float32``)."""
    # F.rms_norm without a weight is that same x * rsqrt(mean(x^2) + eps), in fewer dispatches.
    hidden = F.rms_norm(x.to(torch.float32), x.shape[-1:], eps=eps)
    if multiply_in_float32:
        return (hidden * (weight_offset + weight.to(torch.float32))).to(x.dtype)
    return (weight_offset + weight if weight_offset else weight) * hidden.to(x.dtype)


def _normed_dtype(x_dtype: torch.dtype, weight: torch.Tensor, multiply_in_float32: bool) -> torch.dtype:
    return x_dtype if multiply_in_float32 else torch.promote_types(x_dtype, weight.dtype)


rms_norm_op = torch.library.custom_op("zoo::rms_norm", rms_norm_reference, mutates_args=())


@rms_norm_op.register_fake
def _(x, weight, eps, weight_offset=0.0, multiply_in_float32=False):
    return x.new_empty(x.shape, dtype=_normed_dtype(x.dtype, weight, multiply_in_float32))


@cuda_implementation(rms_norm_op)
def _(x, weight, eps, weight_offset=0.0, multiply_in_float32=False):
    from ops_cuda.triton_kernels import rms_norm_triton  # triton is imported only where a kernel runs

    return rms_norm_triton(x, weight, eps, weight_offset, multiply_in_float32)


rms_norm = public_op(rms_norm_op, rms_norm_reference)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0,
    multiply_in_float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), with ``rms_norm_reference``'s options."""
    summed = residual + x
    return rms_norm_reference(summed, weight, eps, weight_offset, multiply_in_float32), summed


fused_add_rms_norm_op = torch.library.custom_op("zoo::fused_add_rms_norm", fused_add_rms_norm_reference,
                                                mutates_args=())


@fused_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, weight_offset=0.0, multiply_in_float32=False):
    summed_dtype = torch.promote_types(x.dtype, residual.dtype)
    normed_dtype = _normed_dtype(summed_dtype, weight, multiply_in_float32)
    return x.new_empty(x.shape, dtype=normed_dtype), x.new_empty(x.shape, dtype=summed_dtype)


@cuda_implementation(fused_add_rms_norm_op)
def _(x, residual, weight, eps, weight_offset=0.0, multiply_in_float32=False):
    from ops_cuda.triton_kernels import fused_add_rms_norm_triton  # triton is imported only where a kernel runs

    return fused_add_rms_norm_triton(x, residual, weight, eps, weight_offset, multiply_in_float32)


fused_add_rms_norm = public_op(fused_add_rms_norm_op, fused_add_rms_norm_reference)
