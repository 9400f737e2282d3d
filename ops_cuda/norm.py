"""RMSNorm, alone and with the residual add of the previous sub-block fused in."""

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as HuggingFace's LlamaRMSNorm: statistics in float32,
    # cast back to the input dtype before the weight multiply.
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(x.dtype)


@torch.library.custom_op("zoo::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_reference(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("zoo::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    summed = residual + x
    return rms_norm_reference(summed, weight, eps), summed


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)
