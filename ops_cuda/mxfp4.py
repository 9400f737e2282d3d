"""MXFP4 weights (the OCP microscaling format gpt-oss ships its experts in): 4-bit e2m1 values in groups
of 32 along a row, each group sharing a power-of-two scale. A weight [..., rows, columns] is held as

    blocks  uint8 [..., rows, columns / 2]   two values a byte, the earlier column in the low nibble
    scales  uint8 [..., rows, columns / 32]  each group's scale 2^(s - 127) as its e8m0 exponent s

Every value times its scale is exact in bfloat16 and float32 (an e2m1 value has two significant bits),
so a product over dequantised weights equals the product over the bfloat16 weights transformers
dequantises them to, up to the order of the sums. The Triton side: ``mxfp4_triton.py``."""

import torch
import torch.nn.functional as F

# The e2m1 value of each 4-bit code: sign bit, two exponent bits, one mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP_SIZE = 32  # values a scale
GROUP_BYTES = GROUP_SIZE // 2
SCALE_BIAS = 127
CHUNK_GROUPS = 1 << 16  # 2 M values a step


def dequantise_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """uint8 blocks [..., rows, columns / 2] and scales [..., rows, columns / 32] -> ``dtype`` [..., rows, columns].
    Each byte's two values are one row of a 256-row table, gathered as an embedding, times the group's
    power of two (exact in bfloat16 and float32, which compute it; float16, whose range is narrower,
    takes the float32 values): about 1 G values a second on two CPU cores into bfloat16 (the best of three
    calls on 265 M values), where indexing a 16-value table once per nibble took 0.15; gpt-oss-20b's
    experts are 19 G values."""
    compute = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.arange(256, device=blocks.device)
    byte_values = torch.stack([values[codes & 0x0F], values[codes >> 4]], dim=-1).to(compute)  # the low nibble first
    out = torch.empty(*blocks.shape[:-1], 2 * blocks.shape[-1], dtype=dtype, device=blocks.device)
    flat_blocks, flat_scales = blocks.reshape(-1, GROUP_BYTES), scales.reshape(-1, 1, 1)
    flat_out = out.view(-1, GROUP_BYTES, 2)
    for start in range(0, flat_blocks.shape[0], CHUNK_GROUPS):  # the values of a whole tensor would take gigabytes
        rows = slice(start, start + CHUNK_GROUPS)
        factors = torch.exp2(flat_scales[rows].to(torch.float32) - SCALE_BIAS).to(compute)
        torch.mul(F.embedding(flat_blocks[rows].int(), byte_values), factors, out=flat_out[rows])
    return out


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The blocks' and the scales' shapes of an MXFP4 weight of ``shape`` (its columns a multiple of 32)."""
    *outer, columns = shape
    return (*outer, columns // 2), (*outer, columns // GROUP_SIZE)


def check_mxfp4_weight(op: str, name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Raise a ValueError naming ``op`` and the weight ``name`` unless blocks and scales are uint8 of
    matching shapes (sixteen bytes a scale)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"zoo::{op}: {name} blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape[:-1] or blocks.shape[-1] != scales.shape[-1] * GROUP_BYTES:
        raise ValueError(f"zoo::{op}: {name} blocks of shape {tuple(blocks.shape)} with scales of shape "
                         f"{tuple(scales.shape)}; expected [..., rows, columns / 2] and [..., rows, columns / 32]")
