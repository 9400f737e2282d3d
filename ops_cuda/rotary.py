"""Rotary position embedding applied to query and key heads: neox (rotate-half) or interleaved
layout, over all of head_dim, its first rotary_dim channels (partial rotary) or none (a NoPE layer's
zero-width cos/sin: q and k pass through)."""

import torch

from ops_cuda.dispatch import cuda_implementation, public_op


def check_rotary_shapes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    rotary_dim = cos.shape[-1]
    if q.dim() != 3 or k.dim() != 3 or cos.shape != sin.shape or cos.shape != (q.shape[0], rotary_dim):
        raise ValueError(
            f"apply_rotary takes q [N, Hq, D], k [N, Hk, D] and cos/sin [N, rotary_dim], got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    if rotary_dim % 2 or rotary_dim > min(q.shape[-1], k.shape[-1]):
        raise ValueError(
            f"rotary_dim {rotary_dim} must be even and at most head_dim (q {q.shape[-1]}, k {k.shape[-1]})"
        )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:  # HF's DeepSeek-V3 apply_rotary_pos_emb_interleave, operation for operation
        cos, sin = cos[..., : rotary_dim // 2], sin[..., : rotary_dim // 2]
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:  # HF's apply_rotary_pos_emb (Llama; GPT-NeoX / Phi-3 for partial rotary)
        rotated = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat((rotated, x_pass), dim=-1) if x_pass.shape[-1] else rotated


def apply_rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
    rotate_in_float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [N, Hq, D] and k [N, Hk, D] by the angles of each token; returns new tensors.

    cos/sin are [N, rotary_dim] (float32) in the layout ``layers.RotaryEmbedding`` produces:
    ``cos(cat(freqs, freqs))``, the per-pair angles duplicated in both halves. rotary_dim < D is
    partial rotary: the first rotary_dim channels of each head rotate, the rest pass through (all of
    them at rotary_dim 0, a NoPE layer's).

    ``interleaved=False`` (Llama, GPT-NeoX): channel i pairs with i + rotary_dim/2 (rotate-half).
    ``interleaved=True`` (DeepSeek's ``rope_interleave``): channels (2i, 2i+1) rotate together by
    angle i, read from the first half of cos/sin (the same table as the neox layout). The output is
    HF's ``apply_rotary_pos_emb_interleave``: de-interleaved, the rotated even channels first, then
    the odd ones. GLM/GPT-J write the pairs back in place instead; that differs only by a fixed
    permutation of the rotated channels, which q.k does not see when q and k both use this op.

    cos/sin are cast to the activations' dtype first, as HF's Llama rotary embedding returns them;
    with ``rotate_in_float32`` (HF's OLMo 2 and OLMo 3) they stay float32, the products and sums are
    float32's, and the result is rounded to the activations' dtype once.
    """
    check_rotary_shapes(q, k, cos, sin)
    if not rotate_in_float32:
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return _rotate(q, cos, sin, interleaved).to(q.dtype), _rotate(k, cos, sin, interleaved).to(k.dtype)


apply_rotary_op = torch.library.custom_op("zoo::apply_rotary", apply_rotary_reference, mutates_args=())


@apply_rotary_op.register_fake
def _(q, k, cos, sin, interleaved=False, rotate_in_float32=False):
    return torch.empty_like(q), torch.empty_like(k)


@cuda_implementation(apply_rotary_op)
def _(q, k, cos, sin, interleaved=False, rotate_in_float32=False):
    from ops_cuda.triton_kernels import apply_rotary_triton  # triton is imported only where a kernel runs

    check_rotary_shapes(q, k, cos, sin)
    return apply_rotary_triton(q, k, cos, sin, interleaved, rotate_in_float32)


apply_rotary = public_op(apply_rotary_op, apply_rotary_reference)
