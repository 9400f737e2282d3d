"""Rotary position embedding applied to query and key heads (neox / rotate-half layout)."""

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [N, Hq, D], k: [N, Hk, D], cos/sin: [N, D] float32, cast to the activations' dtype as HF does.
    cos = cos.to(q.dtype).unsqueeze(1)
    sin = sin.to(q.dtype).unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@torch.library.custom_op("zoo::apply_rotary", mutates_args=())
def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rotary_reference(q, k, cos, sin)


@apply_rotary.register_fake
def _(q, k, cos, sin):
    return torch.empty_like(q), torch.empty_like(k)
