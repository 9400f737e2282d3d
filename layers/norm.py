"""RMSNorm, in the variants HuggingFace's architectures use, and LayerNorm, each with an optional
fused residual add; and the RMSNorm of a one-row step split between the products around it."""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from layers.weights import OneOf, Shard
from ops_cuda import fused_add_rms_norm, gemv_into_norm, rms_norm
from ops_cuda.dispatch import NORM_SLOTS
from ops_cuda.gemv import split_norm_inverse_rms


class RowProduct(ABC):
    """A one-row product left to the RMSNorm that reads it, which computes it with the first half of
    the norm: what a decoder branch's last product marked ``into_norm`` returns for a single row on
    the GPU (``LinearRowProduct``, ``layers.moe.ExpertsRowProduct``). Only the decoder layers that split
    their norms (``DecoderLayer.splits_norms``) mark their branches' last products so."""

    @abstractmethod
    def into_norm(self, residual: torch.Tensor, norm_weight: torch.Tensor,
                  stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The product plus ``residual`` (summed, the new residual) and summed times ``norm_weight``
        (weighted), with summed's sum of squares added into ``stats``, as ``zoo::gemv_into_norm``."""


@dataclass
class LinearRowProduct(RowProduct):
    """A ``Linear``'s product of one row, x W^T + b (``zoo::gemv_into_norm``)."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None

    def into_norm(self, residual, norm_weight, stats):
        return gemv_into_norm(self.x, self.weight, self.bias, residual, norm_weight, stats)


def new_norm_stats(norms: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Zeroed slots for the sums of squares of split norms: [*norms, NORM_SLOTS] float64."""
    return torch.zeros(*norms, NORM_SLOTS, dtype=torch.float64, device=device)


@dataclass
class NormedRow:
    """One row after an RMSNorm split between the products around it (``ops_cuda.gemv``): the norm's
    input times its weight and the slots that hold its sum of squares. The product that reads it
    (``Linear``, ``GatedMLP``) multiplies its sums by the norm's 1 / rms: the norm takes no launch of
    its own."""

    weighted: torch.Tensor
    stats: torch.Tensor
    eps: float
    dtype: torch.dtype  # the activations'

    @property
    def shape(self) -> torch.Size:
        return self.weighted.shape

    def takes(self, weight: torch.Tensor) -> bool:
        """Whether a product by ``weight`` can read the row split: a weight of the activations' dtype
        with contiguous rows (not FP8)."""
        return weight.dtype == self.dtype and weight.stride(-1) == 1

    def normalised(self) -> torch.Tensor:
        """The normalised row, for a product that cannot read it split."""
        inverse_rms = split_norm_inverse_rms(self.weighted, self.stats, self.eps)
        return (self.weighted.float() * inverse_rms).to(self.dtype)


class RMSNorm(nn.Module):
    """``norm(x)``, or with a residual ``(norm(x + residual), x + residual)``.

    Decoder layers pass the previous sub-block's output together with the running residual,
    so the residual add costs no extra pass over memory.

    The variants are options fixed when the model is built: ``weight_offset`` 1 multiplies by
    ``1 + weight`` (Gemma stores its weight as an offset from one); ``multiply_in_float32``
    multiplies the float32 statistics by the weight before the cast to the input dtype (Gemma,
    OLMo 2), where Llama casts first and multiplies in the input dtype.

    Given a ``RowProduct`` (the branch's last product, left undone), the norm is split: it adds the
    row's sum of squares into ``stats`` (its zeroed slots of the step's, ``DecoderModel``'s
    ``split_norm_stats``) and returns a ``NormedRow`` for the next product, and the residual stream.
    """

    def __init__(self, hidden_size: int, eps: float, weight_offset: float = 0.0, multiply_in_float32: bool = False):
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.multiply_in_float32 = multiply_in_float32
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor | RowProduct, residual: torch.Tensor | None = None,
                stats: torch.Tensor | None = None):
        if isinstance(x, RowProduct):  # split: this product adds the residual, the next one normalises
            summed, weighted = x.into_norm(residual, self.weight, stats)
            return NormedRow(weighted, stats, self.eps, summed.dtype), summed
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.weight_offset, self.multiply_in_float32)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, self.weight_offset, self.multiply_in_float32)

    def extra_repr(self) -> str:
        options = f", weight_offset={self.weight_offset}" if self.weight_offset else ""
        options += ", multiply_in_float32=True" if self.multiply_in_float32 else ""
        return f"{tuple(self.weight.shape)}, eps={self.eps}{options}"


class LayerNorm(nn.Module):
    """``norm(x)``, or with a residual ``(norm(x + residual), x + residual)``, as ``RMSNorm``: the
    mean and variance of the last dimension normalised away, times the weight plus the bias
    (Starcoder2's, StableLM's), as ``torch.nn.LayerNorm`` computes it; ``bias=False``: none
    (Cohere's); ``weight_offset`` 1 multiplies by ``1 + weight``, the sum rounded to the weight's
    dtype (Nemotron's LayerNorm1P stores its weight as an offset from one and adds the one so);
    ``elementwise_affine=False``: neither weight nor bias (OLMo's).
    A ``hidden_size`` of two dimensions, ``(heads, head_dim)``, gives each head a weight of its own
    (Cohere's and StableLM 2 12B's q/k norms); checkpoints hold it stacked (Cohere's ``q_norm.weight``
    [heads, head_dim]) or as one LayerNorm per head (StableLM's ``q_layernorm.norms.{h}.weight``).
    The per-head norm and the one without weight normalise a float32 copy of the input, multiply by
    the weight in float32 and round once to the input's dtype, as HF's ``CohereLayerNorm`` and
    ``OlmoLayerNorm`` do (torch's LayerNorm kernel does the same on the input, summing in an order of
    its own: in bfloat16 an output now and then rounds the other way)."""

    def __init__(self, hidden_size: int | tuple[int, int], eps: float, bias: bool = True, weight_offset: float = 0.0,
                 elementwise_affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.normalized_shape = (hidden_size,) if isinstance(hidden_size, int) else tuple(hidden_size)
        shape = self.normalized_shape
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False) if elementwise_affine else None
        self.bias = nn.Parameter(torch.empty(shape), requires_grad=False) if elementwise_affine and bias else None

    @property
    def per_head(self) -> bool:
        """Whether each head has a weight of its own: a ``hidden_size`` of ``(heads, head_dim)``."""
        return len(self.normalized_shape) == 2

    def checkpoint_shards(self, prefix: str) -> dict[str, OneOf]:
        if not self.per_head:
            return {}
        heads = range(self.normalized_shape[0])
        return {name: OneOf([Shard(f"{prefix}.{name}")], [Shard(f"{prefix}.norms.{h}.{name}", (h,)) for h in heads])
                for name, _ in self.named_parameters(recurse=False)}

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is not None and self.weight_offset:
            weight = weight + self.weight_offset
        if weight is not None and not self.per_head:
            return F.layer_norm(x, self.normalized_shape, weight, self.bias, self.eps)
        normed = F.layer_norm(x.float(), x.shape[-1:], eps=self.eps)
        if weight is not None:
            normed = normed * weight.float()
        if self.bias is not None:
            normed = normed + self.bias.float()
        return normed.to(x.dtype)

    def extra_repr(self) -> str:
        if self.weight is None:
            options = ", elementwise_affine=False"
        else:
            options = "" if self.bias is not None else ", bias=False"
            options += f", weight_offset={self.weight_offset}" if self.weight_offset else ""
        return f"{self.normalized_shape}, eps={self.eps}{options}"
