"""FP8 block-scaled weights (DeepSeek-V3's format): what the loader, the FP8 ops and their kernels share.

A weight ``W [..., N, K]`` is stored as float8_e4m3fn beside ``scale_inv``, one float32 per block of
``block = (rows, columns)`` of its last two dimensions (edge blocks partial): ``W = fp8 * scale_inv``
of the element's block (``dequantise``). Activations are quantised on the fly, one scale per token
and group of ``block[1]`` columns, so that each K-step of a GEMM multiplies two FP8 tiles with one
scale per row and one per column (``quantise_groups_reference``; on the GPU a Triton kernel,
``ops_cuda.fp8_triton.quantise_groups``).

The ops on such weights: ``zoo::fp8_block_linear`` (``ops_cuda/fp8_linear.py``) and
``zoo::fp8_moe_experts`` (``ops_cuda/moe.py``).
"""

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
# CUDA devices with FP8 tensor cores and e4m3 conversions: compute capability 8.9 (Ada) onward.
FP8_CUDA_CAPABILITY = (8, 9)
# The smallest group maximum a scale is taken from: an all-zero group gets a tiny scale, not a zero one.
MIN_GROUP_MAX = 1e-10


def block_scale_shape(shape, block) -> tuple[int, ...]:
    """The scale of a tensor of ``shape``: one per block of its last two dimensions, edge blocks partial."""
    rows, cols = shape[-2:]
    return (*shape[:-2], -(-rows // block[0]), -(-cols // block[1]))


def dequantise(weight: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """float32 ``weight`` times the scale of the block each element lies in."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return weight.float() * scale


def quantise_groups_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, ceil(K / group)]): each row's groups of
    ``group`` columns (the last one partial) divided by their largest magnitude over FP8_MAX, so
    that x ~ fp8 * scale. The scales are laid out column-major (stride (1, M)), as
    ``torch._scaled_mm`` takes them and as the Triton kernels read them best."""
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = F.pad(x.float(), (0, groups * group - cols)).view(rows, groups, group)
    scales = padded.abs().amax(dim=-1).clamp(min=MIN_GROUP_MAX) / FP8_MAX
    quantised = (padded / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantised.view(rows, -1)[:, :cols].contiguous(), scales.t().contiguous().t()


def check_block_weight(op: str, weight: torch.Tensor, scale_inv: torch.Tensor, block) -> None:
    """Raises, naming ``op``, unless ``weight`` is float8_e4m3fn with a float32 ``scale_inv`` of one
    scale per ``block``."""
    if weight.dtype != FP8_DTYPE or scale_inv.dtype != torch.float32:
        raise TypeError(f"zoo::{op} takes a {FP8_DTYPE} weight and float32 scales, got {weight.dtype} and {scale_inv.dtype}")
    if len(block) != 2 or tuple(scale_inv.shape) != block_scale_shape(weight.shape, block):
        raise ValueError(f"zoo::{op}: scales of shape {tuple(scale_inv.shape)} do not match a weight of shape "
                         f"{tuple(weight.shape)} in blocks of {list(block)}")
