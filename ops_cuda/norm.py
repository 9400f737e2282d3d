"""RMSNorm, alone and with the residual add of the previous sub-block fused in."""

import torch
import torch.nn.functional as F

from ops_cuda.dispatch import reference_on_cpu


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x ([N, H], or [N, heads, head_dim] for q/k-norm)."""
    # Same order of operations as HuggingFace's LlamaRMSNorm: statistics in float32,
    # cast back to the input dtype before the weight multiply.
    # F.rms_norm without a weight is that same x * rsqrt(mean(x^2) + eps), in fewer dispatches.
    hidden = F.rms_norm(x.to(torch.float32), x.shape[-1:], eps=eps)
    return weight * hidden.to(x.dtype)


@torch.library.custom_op("zoo::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_reference(x, weight, eps)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@rms_norm_op.register_kernel("cuda")
def _(x, weight, eps):
    from ops_cuda.triton_kernels import rms_norm_triton  # triton is imported only where a kernel runs

    return rms_norm_triton(x, weight, eps)


rms_norm = reference_on_cpu(rms_norm_op, rms_norm_reference)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    summed = residual + x
    return rms_norm_reference(summed, weight, eps), summed


@torch.library.custom_op("zoo::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return fused_add_rms_norm_reference(x, residual, weight, eps)


@fused_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    summed_dtype = torch.promote_types(x.dtype, residual.dtype)
    normed_dtype = torch.promote_types(summed_dtype, weight.dtype)
    return x.new_empty(x.shape, dtype=normed_dtype), x.new_empty(x.shape, dtype=summed_dtype)


@fused_add_rms_norm_op.register_kernel("cuda")
def _(x, residual, weight, eps):
    from ops_cuda.triton_kernels import fused_add_rms_norm_triton  # triton is imported only where a kernel runs

    return fused_add_rms_norm_triton(x, residual, weight, eps)


fused_add_rms_norm = reference_on_cpu(fused_add_rms_norm_op, fused_add_rms_norm_reference)
