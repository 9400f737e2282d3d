"""Triton kernels behind zoo's elementwise ops, single-row matmuls (plain and gated) and argmax:
the ``cuda`` kernels of the ops in this package.

Each kernel has a plain launcher (``rms_norm_triton``, ...) that the op's CUDA registration calls
and that the tests call on CPU tensors under ``TRITON_INTERPRET=1``. This module imports triton,
so the op files import it only inside their CUDA kernels: ``import ops_cuda`` never needs triton.
What the kernel modules share (dtype check, PDL, rounding, activation formulas) is in
``ops_cuda.triton_helpers``.

Kernels compute in float32 and round to the activation dtype wherever the PyTorch reference
rounds (HuggingFace's order of operations), so fp16/bf16 results agree with the reference to
about one unit in the last place. Launch grids depend on shapes only and outputs are allocated
with ``torch.empty``: every op can be captured in a CUDA graph.
"""

import torch
import triton
import triton.language as tl

from ops_cuda.fp8 import FP8_DTYPE, FP8_MAX
from ops_cuda.dispatch import NORM_SLOTS
from ops_cuda.kv_layout import check_cache_layout
from ops_cuda.triton_helpers import (
    KERNEL_ACTIVATIONS,
    begin_after_previous,
    bias_or,
    check_dtypes,
    fullest_tile,
    gated_activation,
    gated_rows_times_vector,
    gated_weight_rows,
    inverse_rms,
    norm_squares,
    pdl_launch,
    resident_programs,
    round_to,
    rows_times_vector,
    store_into_norm,
    weight_tile,
)


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    # Kernels index the last dim with stride 1 and every other dim through its stride.
    return t if t.stride(-1) == 1 else t.contiguous()


def _num_warps(block: int) -> int:
    return min(max(block // 512, 1), 16)


# ---------------------------------------------------------------------------------------------
# RMSNorm, with the residual add fused in
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr,
    rows_per_outer, hidden, eps,
    x_stride_m, x_stride_r, res_stride_m, res_stride_r,
    out_stride_m, out_stride_r, sum_stride_m, sum_stride_r,
    HAS_RESIDUAL: tl.constexpr, WEIGHT_OFFSET: tl.constexpr, MULTIPLY_IN_FLOAT32: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    # One program per row; rows are [M, R] (tokens x heads for q/k-norm, R = 1 otherwise).
    row = tl.program_id(0).to(tl.int64)
    m, r = row // rows_per_outer, row % rows_per_outer
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = x_ptr.dtype.element_ty
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)  # a parameter, read before waiting for x
    begin_after_previous(PDL)
    x = tl.load(x_ptr + m * x_stride_m + r * x_stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + m * res_stride_m + r * res_stride_r + cols, mask=mask, other=0.0)
        x = round_to(x + residual.to(tl.float32), dtype)  # the reference normalises the rounded sum
        tl.store(summed_ptr + m * sum_stride_m + r * sum_stride_r + cols, x.to(dtype), mask=mask)
    variance = tl.sum(x * x, axis=0) / hidden
    normed = x * tl.math.rsqrt(variance + eps)
    out = _times_weight(normed, weight, dtype, WEIGHT_OFFSET, MULTIPLY_IN_FLOAT32)
    tl.store(out_ptr + m * out_stride_m + r * out_stride_r + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _times_weight(normed, weight, dtype: tl.constexpr, WEIGHT_OFFSET: tl.constexpr,
                  MULTIPLY_IN_FLOAT32: tl.constexpr):
    # ``normed`` (x * rsqrt(mean(x^2) + eps), float32) times ``weight`` (as loaded), rounded where
    # rms_norm_reference rounds; the caller casts the product to the output dtype.
    weight_dtype: tl.constexpr = weight.dtype
    weight = weight.to(tl.float32)
    if WEIGHT_OFFSET != 0:
        weight = weight + WEIGHT_OFFSET
    if not MULTIPLY_IN_FLOAT32:  # HF's Llama casts back before the weight multiply
        normed = round_to(normed, dtype)
        if WEIGHT_OFFSET != 0:  # the reference adds the offset in the weight's dtype
            weight = round_to(weight, weight_dtype)
    return normed * weight


def _rows(t: torch.Tensor) -> torch.Tensor:
    # [M, R, H] view of `t` as rows of its last dim; 3D inputs (q/k heads, possibly strided views
    # of a fused qkv) keep their strides, other ranks are flattened (a copy only when they must).
    t = _unit_stride(t)
    return t if t.dim() == 3 else t.reshape(-1, 1, t.shape[-1])


def _rms_norm_launch(x, residual, weight, eps, weight_offset, multiply_in_float32):
    hidden = x.shape[-1]
    out_dtype = x.dtype if multiply_in_float32 else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    rows_x, rows_out = _rows(x), _rows(out)
    # Without a residual, the residual/summed arguments are unused: pass x and out in their place.
    rows_res = _rows(residual) if residual is not None else rows_x
    rows_sum = _rows(summed) if residual is not None else rows_out
    block = triton.next_power_of_2(hidden)
    m, r = rows_x.shape[:2]
    _rms_norm_kernel[(m * r,)](
        rows_x, rows_res, weight.contiguous(), rows_out, rows_sum,
        r, hidden, eps,
        rows_x.stride(0), rows_x.stride(1), rows_res.stride(0), rows_res.stride(1),
        rows_out.stride(0), rows_out.stride(1), rows_sum.stride(0), rows_sum.stride(1),
        HAS_RESIDUAL=residual is not None, WEIGHT_OFFSET=float(weight_offset), MULTIPLY_IN_FLOAT32=multiply_in_float32,
        BLOCK=block, num_warps=_num_warps(block), **pdl_launch(x),
    )
    return out, summed


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0, multiply_in_float32: bool = False
) -> torch.Tensor:
    check_dtypes("rms_norm", x)
    return _rms_norm_launch(x, None, weight, eps, weight_offset, multiply_in_float32)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0,
    multiply_in_float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_dtypes("fused_add_rms_norm", x, residual)
    return _rms_norm_launch(x, residual, weight, eps, weight_offset, multiply_in_float32)


# ---------------------------------------------------------------------------------------------
# Gated activations
# ---------------------------------------------------------------------------------------------

@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, d, x_stride, out_stride,
                        ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    begin_after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    out = gated_activation(gate, up, dtype, ACTIVATION)
    tl.store(out_ptr + row * out_stride + cols, out.to(dtype), mask=mask)


def act_and_mul_triton(x: torch.Tensor, activation: str) -> torch.Tensor:
    check_dtypes("act_and_mul", x)
    if activation not in KERNEL_ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r}; supported: {sorted(KERNEL_ACTIVATIONS)}")
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    rows_x, rows_out = _unit_stride(x).reshape(-1, 2 * d), out.view(-1, d)
    block = min(triton.next_power_of_2(d), 1024)
    _act_and_mul_kernel[(rows_x.shape[0], triton.cdiv(d, block))](
        rows_x, rows_out, d, rows_x.stride(0), rows_out.stride(0),
        ACTIVATION=KERNEL_ACTIVATIONS[activation], BLOCK=block, num_warps=4, **pdl_launch(x),
    )
    return out


# ---------------------------------------------------------------------------------------------
# Rotary embedding
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rotation_round(x, dtype: tl.constexpr, ROTATE_IN_FLOAT32: tl.constexpr):
    # A value of the rotation rounded to the activations' dtype, where the reference rounds it: not
    # where it rotates in float32.
    if not ROTATE_IN_FLOAT32:
        x = round_to(x, dtype)
    return x


@triton.jit
def _angles(cos_ptr, sin_ptr, token, cos_stride, sin_stride, rotary_dim, dtype: tl.constexpr,
            INTERLEAVED: tl.constexpr, ROTATE_IN_FLOAT32: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # cos/sin of each output pair of one token, [1, BLOCK_HALF] each, as the activations' dtype
    # (the reference casts them), or float32's with ROTATE_IN_FLOAT32. The neox layout reads both
    # halves of the table, the interleaved one (one angle per pair) the first half.
    half = rotary_dim // 2
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = i < half
    cos1 = tl.load(cos_ptr + token * cos_stride + i, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + token * sin_stride + i, mask=mask, other=0.0).to(tl.float32)
    cos1, sin1 = _rotation_round(cos1, dtype, ROTATE_IN_FLOAT32), _rotation_round(sin1, dtype, ROTATE_IN_FLOAT32)
    if INTERLEAVED:
        cos2, sin2 = cos1, sin1
    else:
        cos2 = tl.load(cos_ptr + token * cos_stride + half + i, mask=mask, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + token * sin_stride + half + i, mask=mask, other=0.0).to(tl.float32)
        cos2, sin2 = _rotation_round(cos2, dtype, ROTATE_IN_FLOAT32), _rotation_round(sin2, dtype, ROTATE_IN_FLOAT32)
    return cos1, sin1, cos2, sin2


@triton.jit
def _pair_channels(rotary_dim, INTERLEAVED: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # Output channel i < half takes pair (x1, x2) = channels (i, i + half) in the neox layout,
    # (2i, 2i + 1) in the interleaved one, and its partner goes to i + half: HF's rotate-half and
    # DeepSeek-interleave formulas write the same output positions.
    half = rotary_dim // 2
    i = tl.arange(0, BLOCK_HALF)[None, :]
    if INTERLEAVED:
        in1, in2 = 2 * i, 2 * i + 1
    else:
        in1, in2 = i, i + half
    return i, in1, in2


@triton.jit
def _rotate_pair(x1, x2, cos1, sin1, cos2, sin2, dtype: tl.constexpr, ROTATE_IN_FLOAT32: tl.constexpr):
    # Each product rounded like the reference's (float32's alone with ROTATE_IN_FLOAT32), then the
    # sum: bit-equal in fp16/bf16 once the caller casts the float32 results to ``dtype``.
    first = _rotation_round(x1 * cos1, dtype, ROTATE_IN_FLOAT32) - _rotation_round(x2 * sin1, dtype, ROTATE_IN_FLOAT32)
    second = _rotation_round(x2 * cos2, dtype, ROTATE_IN_FLOAT32) + _rotation_round(x1 * sin2, dtype, ROTATE_IN_FLOAT32)
    return first, second


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
    q_heads, k_heads, q_dim, k_dim, rotary_dim, cos_stride, sin_stride,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, qo_stride_t, qo_stride_h, ko_stride_t, ko_stride_h,
    INTERLEAVED: tl.constexpr, ROTATE_IN_FLOAT32: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr, PDL: tl.constexpr,
):
    # One program per (token, block of BLOCK_H heads), rotating those heads of both q and k.
    begin_after_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    cos1, sin1, cos2, sin2 = _angles(cos_ptr, sin_ptr, token, cos_stride, sin_stride, rotary_dim,
                                     q_out_ptr.dtype.element_ty, INTERLEAVED, ROTATE_IN_FLOAT32, BLOCK_HALF)
    # rotary_write_kv's per-head step with no norm and no cache: its weights and cache pointer are unread.
    _norm_rotate_heads(q_ptr, 0.0, 0.0, 0.0, q_out_ptr, q_out_ptr, token, h, q_heads, 0, q_dim, rotary_dim, 0.0, 1.0,
                       q_stride_t, q_stride_h, qo_stride_t, qo_stride_h, 0, cos1, sin1, cos2, sin2,
                       NORM=False, WEIGHT_OFFSET=0.0, MULTIPLY_IN_FLOAT32=False, INTERLEAVED=INTERLEAVED,
                       ROTATE_IN_FLOAT32=ROTATE_IN_FLOAT32, WRITE_CACHE=False, FP8=False, ROUND_TO_E4M3=False,
                       BLOCK_HALF=BLOCK_HALF, BLOCK_PASS=BLOCK_PASS, BLOCK_D=16)
    _norm_rotate_heads(k_ptr, 0.0, 0.0, 0.0, k_out_ptr, k_out_ptr, token, h, k_heads, 0, k_dim, rotary_dim, 0.0, 1.0,
                       k_stride_t, k_stride_h, ko_stride_t, ko_stride_h, 0, cos1, sin1, cos2, sin2,
                       NORM=False, WEIGHT_OFFSET=0.0, MULTIPLY_IN_FLOAT32=False, INTERLEAVED=INTERLEAVED,
                       ROTATE_IN_FLOAT32=ROTATE_IN_FLOAT32, WRITE_CACHE=False, FP8=False, ROUND_TO_E4M3=False,
                       BLOCK_HALF=BLOCK_HALF, BLOCK_PASS=BLOCK_PASS, BLOCK_D=16)


def _rotary_tiles(head_dim: int, rotary_dim: int) -> tuple[int, int]:
    """BLOCK_HALF and BLOCK_PASS of the rotary kernels: lanes for the rotated pairs and for the channels
    past ``rotary_dim`` (0: none pass). Where no channel rotates (a NoPE layer's zero-width cos/sin),
    one pair lane, masked off: every channel passes."""
    block_half = triton.next_power_of_2(max(rotary_dim // 2, 1))
    block_pass = triton.next_power_of_2(head_dim - rotary_dim) if head_dim > rotary_dim else 0
    return block_half, block_pass


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
    rotate_in_float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """zoo::apply_rotary on shapes the op has checked (``ops_cuda.rotary.check_rotary_shapes``)."""
    check_dtypes("apply_rotary", q, k)
    q, k, cos, sin = _unit_stride(q), _unit_stride(k), _unit_stride(cos), _unit_stride(sin)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    rotary_dim = cos.shape[-1]
    block_half, block_pass = _rotary_tiles(max(q.shape[-1], k.shape[-1]), rotary_dim)
    # Tiles of ~1024 pairs: wide loads, no register spills, and several programs per token.
    max_heads = max(q.shape[1], k.shape[1])
    block_h = min(max(1024 // block_half, 1), triton.next_power_of_2(max_heads))
    _rotary_kernel[(q.shape[0], triton.cdiv(max_heads, block_h))](
        q, k, q_out, k_out, cos, sin,
        q.shape[1], k.shape[1], q.shape[2], k.shape[2], rotary_dim, cos.stride(0), sin.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        INTERLEAVED=interleaved, ROTATE_IN_FLOAT32=rotate_in_float32, BLOCK_H=block_h, BLOCK_HALF=block_half,
        BLOCK_PASS=block_pass, num_warps=4,
        # No fused multiply-adds: one would skip the rounding of a product that the reference
        # rounds, and move a sixth of bf16 outputs by one unit (zoo's bf16 logits then agreed with
        # HF's on 97.7% of top-1 tokens instead of 100%).
        enable_fp_fusion=False, **pdl_launch(q),
    )
    return q_out, k_out


# ---------------------------------------------------------------------------------------------
# Paged KV cache write
# ---------------------------------------------------------------------------------------------


FP8_LIMIT = tl.constexpr(FP8_MAX)
E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
# float32's unit in [2**14, 2**15) is e4m3's subnormal step, 2**-9: adding this rounds to it.
E4M3_SUBNORMAL_ROUNDER = tl.constexpr(1.5 * 2.0**14)


@triton.jit
def _round_to_e4m3(x):
    # float32 ``x`` (within +-448) rounded to the nearest e4m3 value, ties to even, so the cast
    # after it is exact: for Triton's interpreter, which carries a rounded-up mantissa into the
    # wrong bits (0.49 -> 0.25). The GPU's cast rounds to nearest even itself.
    bits = x.to(tl.int32, bitcast=True)
    # Normal range: keep 3 of float32's 23 mantissa bits, ties to even.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    tiny = (tl.abs(x) + E4M3_SUBNORMAL_ROUNDER) - E4M3_SUBNORMAL_ROUNDER
    tiny = tl.where(bits < 0, -tiny, tiny)
    return tl.where(tl.abs(x) >= E4M3_MIN_NORMAL, normal, tiny)


@triton.jit
def _quantize(values, scale, FP8: tl.constexpr, ROUND_TO_E4M3: tl.constexpr):
    # float32 ``values`` as the cache stores them, before the cast to its dtype (kv_cache.quantize).
    values = values / scale  # exact where the scale is 1.0
    if FP8:  # saturated to the e4m3 range: a cast alone turns values past it into NaN; a NaN stays NaN
        values = tl.minimum(tl.maximum(values, -FP8_LIMIT, propagate_nan=tl.PropagateNan.ALL), FP8_LIMIT,
                            propagate_nan=tl.PropagateNan.ALL)
        if ROUND_TO_E4M3:
            values = _round_to_e4m3(values)
    return values


@triton.jit
def _copy_to_slot(
    src_ptr, cache_ptr, token, block, offset, h, num_heads, head_dim, scale,
    src_stride_t, src_stride_h, cache_stride_b, cache_stride_o, cache_stride_h, cache_stride_d,
    BLOCK_D: tl.constexpr, FP8: tl.constexpr, ROUND_TO_E4M3: tl.constexpr,
    weight=0.0, eps=0.0, NORM: tl.constexpr = False, WEIGHT_OFFSET: tl.constexpr = 0.0,
    MULTIPLY_IN_FLOAT32: tl.constexpr = False,
):
    # Heads h ([BLOCK_H, 1]) of one token into the cache's slot (block, offset); the cache's dims
    # lie cache_stride_d apart (a key-minor V cache: block_size). With NORM, each head RMS-normalised
    # first (``weight`` [1, BLOCK_D]), rounded as rms_norm_reference rounds.
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_heads) & (d < head_dim)
    src = src_ptr + token * src_stride_t + h * src_stride_h
    values = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        inv_rms = tl.math.rsqrt(tl.sum(values * values, axis=1)[:, None] / head_dim + eps)
        values = round_to(_times_weight(values * inv_rms, weight, src_ptr.dtype.element_ty, WEIGHT_OFFSET,
                                        MULTIPLY_IN_FLOAT32), src_ptr.dtype.element_ty)
    values = _quantize(values, scale, FP8, ROUND_TO_E4M3)
    dst = cache_ptr + block * cache_stride_b + offset * cache_stride_o + h * cache_stride_h + d * cache_stride_d
    tl.store(dst, values.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, block_size, num_heads, k_dim, v_dim, k_scale, v_scale,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    kc_stride_b, kc_stride_o, kc_stride_h, vc_stride_b, vc_stride_o, vc_stride_h, vc_stride_d,
    BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, FP8: tl.constexpr,
    ROUND_TO_E4M3: tl.constexpr, PDL: tl.constexpr,
):
    begin_after_previous(PDL)
    token = tl.program_id(0).to(tl.int64)  # one program per token
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block, offset = slot // block_size, slot % block_size
    # A negative slot (padding of a captured batch) has no heads to write: every access is masked.
    num_heads = tl.where(slot >= 0, num_heads, 0)
    h = tl.arange(0, BLOCK_H)[:, None]
    _copy_to_slot(k_ptr, k_cache_ptr, token, block, offset, h, num_heads, k_dim, k_scale,
                  k_stride_t, k_stride_h, kc_stride_b, kc_stride_o, kc_stride_h, 1, BLOCK_DK, FP8, ROUND_TO_E4M3)
    _copy_to_slot(v_ptr, v_cache_ptr, token, block, offset, h, num_heads, v_dim, v_scale,
                  v_stride_t, v_stride_h, vc_stride_b, vc_stride_o, vc_stride_h, vc_stride_d, BLOCK_DV, FP8,
                  ROUND_TO_E4M3)


def write_kv_cache_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    check_cache_layout("write_kv_cache", k_cache, v_cache)
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"zoo::write_kv_cache needs one dtype for both caches, got {k_cache.dtype} and {v_cache.dtype}")
    k, v, slot_mapping = _unit_stride(k), _unit_stride(v), slot_mapping.contiguous()
    num_heads = k.shape[1]
    block_h = triton.next_power_of_2(num_heads)
    block_dk, block_dv = triton.next_power_of_2(k.shape[2]), triton.next_power_of_2(v.shape[2])
    _write_kv_cache_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, k_cache.shape[1], num_heads, k.shape[2], v.shape[2],
        float(k_scale), float(v_scale), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *v_cache.stride(),
        BLOCK_H=block_h, BLOCK_DK=block_dk, BLOCK_DV=block_dv, FP8=k_cache.dtype == FP8_DTYPE,
        ROUND_TO_E4M3=not k.is_cuda,  # the interpreter's tensors are on the CPU
        num_warps=_num_warps(block_h * max(block_dk, block_dv)), **pdl_launch(k),
    )


# ---------------------------------------------------------------------------------------------
# Per-head q/k RMSNorm, rotary and the KV-cache write of an attention layer's new tokens, fused
# ---------------------------------------------------------------------------------------------


@triton.jit
def _load_normed(src, cols, mask, inv_rms, weight, dtype: tl.constexpr, NORM: tl.constexpr,
                 WEIGHT_OFFSET: tl.constexpr, MULTIPLY_IN_FLOAT32: tl.constexpr):
    # Channels ``cols`` of heads ``src`` ([BLOCK_H, 1] pointers), RMS-normalised as rms_norm_reference
    # rounds them when NORM, by ``weight`` (the norm weight at ``cols``); float32 values of ``dtype``.
    x = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        x = round_to(_times_weight(x * inv_rms, weight, dtype, WEIGHT_OFFSET, MULTIPLY_IN_FLOAT32), dtype)
    return x


@triton.jit
def _norm_weights(weight_ptr, head_dim, rotary_dim, NORM: tl.constexpr, INTERLEAVED: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    # The per-head norm's weight at the channels _norm_rotate_heads reads (each pair's two, then the
    # channels past rotary_dim), loaded up front: a parameter, read before waiting for q and k.
    # Without NORM, none.
    w1, w2, w_pass = 0.0, 0.0, 0.0
    if NORM:
        i, in1, in2 = _pair_channels(rotary_dim, INTERLEAVED, BLOCK_HALF)
        pair_ok = i < rotary_dim // 2
        w1 = tl.load(weight_ptr + in1, mask=pair_ok, other=0.0)
        w2 = tl.load(weight_ptr + in2, mask=pair_ok, other=0.0)
        if BLOCK_PASS > 0:
            passed = rotary_dim + tl.arange(0, BLOCK_PASS)[None, :]
            w_pass = tl.load(weight_ptr + passed, mask=passed < head_dim, other=0.0)
    return w1, w2, w_pass


@triton.jit
def _norm_rotate_heads(
    x_ptr, w1, w2, w_pass, out_ptr, cache_ptr, token, h, num_heads, cache_heads, head_dim, rotary_dim, eps, scale,
    x_stride_t, x_stride_h, out_stride_t, out_stride_h, cache_stride_h, cos1, sin1, cos2, sin2,
    NORM: tl.constexpr, WEIGHT_OFFSET: tl.constexpr, MULTIPLY_IN_FLOAT32: tl.constexpr, INTERLEAVED: tl.constexpr,
    ROTATE_IN_FLOAT32: tl.constexpr, WRITE_CACHE: tl.constexpr, FP8: tl.constexpr, ROUND_TO_E4M3: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Heads h ([BLOCK_H, 1]) of one token: normalised (NORM, by _norm_weights' w1, w2, w_pass), rotated,
    # stored to out and, for the first ``cache_heads`` of them (WRITE_CACHE), to the cache row
    # ``cache_ptr`` of the token's slot.
    dtype = out_ptr.dtype.element_ty
    half = rotary_dim // 2
    heads = h < num_heads
    src = x_ptr + token * x_stride_t + h * x_stride_h
    dst = out_ptr + token * out_stride_t + h * out_stride_h
    cached = cache_ptr + h * cache_stride_h
    inv_rms = 0.0
    if NORM:  # the statistics over the whole head, as _rms_norm_kernel computes them
        d = tl.arange(0, BLOCK_D)[None, :]
        row = tl.load(src + d, mask=heads & (d < head_dim), other=0.0).to(tl.float32)
        inv_rms = tl.math.rsqrt(tl.sum(row * row, axis=1)[:, None] / head_dim + eps)
    i, in1, in2 = _pair_channels(rotary_dim, INTERLEAVED, BLOCK_HALF)
    pair_ok = i < half
    mask = heads & pair_ok
    x1 = _load_normed(src, in1, mask, inv_rms, w1, dtype, NORM, WEIGHT_OFFSET, MULTIPLY_IN_FLOAT32)
    x2 = _load_normed(src, in2, mask, inv_rms, w2, dtype, NORM, WEIGHT_OFFSET, MULTIPLY_IN_FLOAT32)
    first, second = _rotate_pair(x1, x2, cos1, sin1, cos2, sin2, dtype, ROTATE_IN_FLOAT32)
    first, second = round_to(first, dtype), round_to(second, dtype)
    tl.store(dst + i, first.to(dtype), mask=mask)
    tl.store(dst + half + i, second.to(dtype), mask=mask)
    cache_dtype = cache_ptr.dtype.element_ty
    cache_mask = (h < cache_heads) & pair_ok
    if WRITE_CACHE:
        tl.store(cached + i, _quantize(first, scale, FP8, ROUND_TO_E4M3).to(cache_dtype), mask=cache_mask)
        tl.store(cached + half + i, _quantize(second, scale, FP8, ROUND_TO_E4M3).to(cache_dtype), mask=cache_mask)
    if BLOCK_PASS > 0:  # partial rotary: channels rotary_dim.. pass through (normalised)
        passed = rotary_dim + tl.arange(0, BLOCK_PASS)[None, :]
        pass_ok = passed < head_dim
        x = _load_normed(src, passed, heads & pass_ok, inv_rms, w_pass, dtype, NORM, WEIGHT_OFFSET,
                         MULTIPLY_IN_FLOAT32)
        tl.store(dst + passed, x.to(dtype), mask=heads & pass_ok)
        if WRITE_CACHE:
            tl.store(cached + passed, _quantize(x, scale, FP8, ROUND_TO_E4M3).to(cache_dtype),
                     mask=(h < cache_heads) & pass_ok)


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr, v_weight_ptr,
    k_cache_ptr, v_cache_ptr, slot_ptr,
    q_heads, kv_heads, head_dim, v_dim, rotary_dim, eps, block_size, k_scale, v_scale, cos_stride, sin_stride,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    qo_stride_t, qo_stride_h, ko_stride_t, ko_stride_h,
    kc_stride_b, kc_stride_o, kc_stride_h, vc_stride_b, vc_stride_o, vc_stride_h, vc_stride_d,
    NORM: tl.constexpr, V_NORM: tl.constexpr, WEIGHT_OFFSET: tl.constexpr, MULTIPLY_IN_FLOAT32: tl.constexpr,
    INTERLEAVED: tl.constexpr, ROTATE_IN_FLOAT32: tl.constexpr, FP8: tl.constexpr, ROUND_TO_E4M3: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HV: tl.constexpr, BLOCK_DV: tl.constexpr, PDL: tl.constexpr,
):
    # One program per (token, block of BLOCK_H heads): those heads of q and k, and BLOCK_HV of v's
    # (v has at most k's heads: no wider a tile than they fill, for a latent of 512 values).
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    hv = tl.program_id(1) * BLOCK_HV + tl.arange(0, BLOCK_HV)[:, None]
    slot = tl.load(slot_ptr + token).to(tl.int64)  # the step's metadata, written before its first kernel
    q_w1, q_w2, q_w_pass = _norm_weights(q_weight_ptr, head_dim, rotary_dim, NORM, INTERLEAVED, BLOCK_HALF, BLOCK_PASS)
    k_w1, k_w2, k_w_pass = _norm_weights(k_weight_ptr, head_dim, rotary_dim, NORM, INTERLEAVED, BLOCK_HALF, BLOCK_PASS)
    v_w = 0.0
    if V_NORM:
        dv = tl.arange(0, BLOCK_DV)[None, :]
        v_w = tl.load(v_weight_ptr + dv, mask=dv < v_dim, other=0.0)
    begin_after_previous(PDL)
    block, offset = slot // block_size, slot % block_size
    # A negative slot (padding of a captured batch) has no heads to write: every cache access is masked.
    cache_heads = tl.where(slot >= 0, kv_heads, 0)
    cos1, sin1, cos2, sin2 = _angles(cos_ptr, sin_ptr, token, cos_stride, sin_stride, rotary_dim,
                                     q_out_ptr.dtype.element_ty, INTERLEAVED, ROTATE_IN_FLOAT32, BLOCK_HALF)
    _norm_rotate_heads(q_ptr, q_w1, q_w2, q_w_pass, q_out_ptr, k_cache_ptr, token, h, q_heads, 0, head_dim,
                       rotary_dim, eps, 1.0, q_stride_t, q_stride_h, qo_stride_t, qo_stride_h, 0, cos1, sin1, cos2, sin2,
                       NORM, WEIGHT_OFFSET, MULTIPLY_IN_FLOAT32, INTERLEAVED, ROTATE_IN_FLOAT32, False, FP8,
                       ROUND_TO_E4M3, BLOCK_HALF, BLOCK_PASS, BLOCK_D)
    k_row = k_cache_ptr + block * kc_stride_b + offset * kc_stride_o
    _norm_rotate_heads(k_ptr, k_w1, k_w2, k_w_pass, k_out_ptr, k_row, token, h, kv_heads, cache_heads, head_dim,
                       rotary_dim, eps, k_scale, k_stride_t, k_stride_h, ko_stride_t, ko_stride_h, kc_stride_h,
                       cos1, sin1, cos2, sin2, NORM, WEIGHT_OFFSET, MULTIPLY_IN_FLOAT32, INTERLEAVED,
                       ROTATE_IN_FLOAT32, True, FP8, ROUND_TO_E4M3, BLOCK_HALF, BLOCK_PASS, BLOCK_D)
    _copy_to_slot(v_ptr, v_cache_ptr, token, block, offset, hv, cache_heads, v_dim, v_scale,
                  v_stride_t, v_stride_h, vc_stride_b, vc_stride_o, vc_stride_h, vc_stride_d, BLOCK_DV, FP8,
                  ROUND_TO_E4M3, v_w, eps, V_NORM, WEIGHT_OFFSET, MULTIPLY_IN_FLOAT32)


def rotary_write_kv_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
    interleaved: bool = False, q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 0.0, weight_offset: float = 0.0, multiply_in_float32: bool = False,
    v_norm_weight: torch.Tensor | None = None, rotate_in_float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """zoo::rotary_write_kv on inputs the op has checked (``ops_cuda.rotary_kv.check_rotary_write_kv``)."""
    norm, v_norm = q_norm_weight is not None, v_norm_weight is not None
    norm_weights = [w for w in (q_norm_weight, k_norm_weight, v_norm_weight) if w is not None]
    check_dtypes("rotary_write_kv", q, k, v, *norm_weights)
    check_cache_layout("rotary_write_kv", k_cache, v_cache)
    q, k, v, cos, sin = (_unit_stride(t) for t in (q, k, v, cos, sin))
    slot_mapping = slot_mapping.contiguous()
    q_weight, k_weight = (q_norm_weight.contiguous(), k_norm_weight.contiguous()) if norm else (q, k)
    v_weight = v_norm_weight.contiguous() if v_norm else v
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    head_dim, rotary_dim = q.shape[2], cos.shape[-1]
    block_half, block_pass = _rotary_tiles(head_dim, rotary_dim)
    block_d = triton.next_power_of_2(head_dim)
    # Tiles of ~2048 channels: a whole head per row (its RMS statistics), several programs per token.
    max_heads = max(q.shape[1], k.shape[1])
    block_h = min(max(2048 // block_d, 1), triton.next_power_of_2(max_heads))
    _rotary_write_kv_kernel[(q.shape[0], triton.cdiv(max_heads, block_h))](
        q, k, v, q_out, k_out, cos, sin, q_weight, k_weight, v_weight, k_cache, v_cache, slot_mapping,
        q.shape[1], k.shape[1], head_dim, v.shape[2], rotary_dim, float(norm_eps), k_cache.shape[1],
        float(k_scale), float(v_scale), cos.stride(0), sin.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *v_cache.stride(),
        NORM=norm, V_NORM=v_norm, WEIGHT_OFFSET=float(weight_offset), MULTIPLY_IN_FLOAT32=multiply_in_float32,
        INTERLEAVED=interleaved, ROTATE_IN_FLOAT32=rotate_in_float32, FP8=k_cache.dtype == FP8_DTYPE,
        ROUND_TO_E4M3=not q.is_cuda,  # the interpreter's tensors are on the CPU
        BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=block_pass, BLOCK_D=block_d,
        BLOCK_HV=min(block_h, triton.next_power_of_2(k.shape[1])), BLOCK_DV=triton.next_power_of_2(v.shape[2]),
        num_warps=4,
        enable_fp_fusion=False,  # as the rotary kernel: every product rounded where the reference rounds
        **pdl_launch(q),
    )
    return q_out, k_out


# ---------------------------------------------------------------------------------------------
# Matrix-vector product
# ---------------------------------------------------------------------------------------------

# A program's weight tile: GEMV_BLOCK_N rows (off the GPU, and where gemv_rows finds a tie) x GEMV_BLOCK_K
# columns, the fastest single tile for a whole decode step (docs/performance.md). On a GPU zoo::gemv takes
# one of GEMV_ROWS rows, by the weight's shape (gemv_rows).
GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_WARPS = 4, 1024, 4
GEMV_ROWS = (2, 4, 8)


@triton.jit
def gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, stats_ptr, N, K, w_stride, eps,
                HAS_BIAS: tl.constexpr, NORMED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PDL: tl.constexpr):
    # BLOCK_N weight rows per program. The first weight tile and the bias are read before waiting
    # for the previous kernel. NORMED: x is a split norm's weighted input (gemv_into_norm_kernel's),
    # whose 1 / rms scales the products.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_starts = w_ptr + rows[:, None].to(tl.int64) * w_stride
    first_tile = weight_tile(row_starts, row_ok[:, None], tl.arange(0, BLOCK_K), K)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    begin_after_previous(PDL)
    squares = norm_squares(stats_ptr) if NORMED else 0.0
    out = rows_times_vector(x_ptr, row_starts, row_ok[:, None], K, first_tile, BLOCK_K)
    if NORMED:
        out *= inverse_rms(squares, K, eps)
    if HAS_BIAS:
        out += bias
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def gemv_into_norm_kernel(x_ptr, w_ptr, bias_ptr, residual_ptr, norm_weight_ptr, summed_ptr, weighted_ptr,
                          stats_ptr, N, K, w_stride, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # gemv_kernel's product, then the first half of the RMSNorm that reads it: the residual add
    # (summed), the norm's weight (weighted: summed times it) and the rows' sum of squares, added
    # into the norm's slots.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_starts = w_ptr + rows[:, None].to(tl.int64) * w_stride
    first_tile = weight_tile(row_starts, row_ok[:, None], tl.arange(0, BLOCK_K), K)
    bias = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    norm_weight = tl.load(norm_weight_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    begin_after_previous(PDL)
    out = rows_times_vector(x_ptr, row_starts, row_ok[:, None], K, first_tile, BLOCK_K) + bias
    store_into_norm(round_to(out, summed_ptr.dtype.element_ty), rows, row_ok, residual_ptr, norm_weight, summed_ptr,
                    weighted_ptr, stats_ptr)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype | None = None, rows: int | None = None) -> torch.Tensor:
    """zoo::gemv's kernel, ``rows`` weight rows per program: by default ``gemv_rows``'s choice on a
    GPU and GEMV_BLOCK_N elsewhere (the tests pass each of GEMV_ROWS)."""
    args, options = gemv_launch(x, weight, bias, out_dtype)
    return _launch_gemv(args, options, rows).view(*x.shape[:-1], weight.shape[0])


def normed_gemv_triton(weighted: torch.Tensor, stats: torch.Tensor, eps: float, weight: torch.Tensor,
                       bias: torch.Tensor | None, rows: int | None = None) -> torch.Tensor:
    """zoo::normed_gemv's kernel: gemv_kernel on a split norm's weighted input, its products times the
    norm's 1 / rms; ``rows`` as ``gemv_triton`` takes it."""
    check_norm_stats("normed_gemv", stats)
    args, options = gemv_launch(weighted, weight, bias, None, (stats, eps))
    return _launch_gemv(args, options, rows).view(*weighted.shape[:-1], weight.shape[0])


def _launch_gemv(args: tuple, options: dict, rows: int | None) -> torch.Tensor:
    if rows is None:
        rows = gemv_rows(args, options) if args[0].is_cuda else GEMV_BLOCK_N
    gemv_kernel[(triton.cdiv(args[1].shape[0], rows),)](*args, BLOCK_N=rows, **options)
    return args[3]


def gemv_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None,
                norm: tuple[torch.Tensor, float] | None = None) -> tuple[tuple, dict]:
    """gemv_kernel's arguments (the output allocated) and options but its rows per program; ``norm``,
    where given, is a split norm's sums of squares and epsilon, and x its weighted input."""
    check_dtypes("gemv", x, weight, *(() if bias is None else (bias,)))
    n, k = weight.shape
    if x.numel() != k:
        raise ValueError(f"zoo::gemv multiplies one row: x has shape {tuple(x.shape)} for a weight of {k} columns")
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"zoo::gemv writes {x.dtype} or float32, not {out_dtype}")
    weight, row = _unit_stride(weight), x.reshape(k).contiguous()
    out = torch.empty(n, dtype=out_dtype or x.dtype, device=x.device)
    stats, eps = norm if norm is not None else (row, 0.0)
    args = (row, weight, bias_or(bias, row), out, stats, n, k, weight.stride(0), float(eps))
    options = dict(HAS_BIAS=bias is not None, NORMED=norm is not None,
                   BLOCK_K=min(GEMV_BLOCK_K, triton.next_power_of_2(k)), num_warps=GEMV_WARPS, **pdl_launch(x))
    return args, options


def check_norm_stats(op: str, stats: torch.Tensor) -> None:
    """Raises unless ``stats`` is a split norm's NORM_SLOTS float64 sums of squares."""
    if stats.dtype != torch.float64 or stats.shape != (NORM_SLOTS,):
        raise ValueError(f"zoo::{op} takes a split norm's {NORM_SLOTS} float64 sums of squares; "
                         f"got {stats.dtype} of shape {tuple(stats.shape)}")


def gemv_into_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                          norm_weight: torch.Tensor, stats: torch.Tensor,
                          rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """zoo::gemv_into_norm's kernel: returns (summed, weighted) and adds the sums of squares into
    ``stats``; ``rows`` as ``gemv_triton`` takes it."""
    check_dtypes("gemv_into_norm", x, weight, residual, norm_weight, *(() if bias is None else (bias,)))
    check_norm_stats("gemv_into_norm", stats)
    n, k = weight.shape
    if x.numel() != k or residual.numel() != n or norm_weight.shape != (n,):
        raise ValueError(f"zoo::gemv_into_norm multiplies one row of {k} values by a weight of shape "
                         f"{tuple(weight.shape)} into a norm of {n}: got x {tuple(x.shape)}, residual "
                         f"{tuple(residual.shape)}, norm weight {tuple(norm_weight.shape)}")
    weight, row = _unit_stride(weight), x.reshape(k).contiguous()
    summed, weighted = torch.empty_like(residual), torch.empty_like(residual)
    args = (row, weight, bias_or(bias, row), residual.contiguous(), norm_weight.contiguous(), summed, weighted,
            stats, n, k, weight.stride(0))
    options = dict(HAS_BIAS=bias is not None, BLOCK_K=min(GEMV_BLOCK_K, triton.next_power_of_2(k)),
                   num_warps=GEMV_WARPS, **pdl_launch(x))
    if rows is None:
        rows = rows_per_program(gemv_into_norm_kernel, args, options, weight, summed) if x.is_cuda else GEMV_BLOCK_N
    gemv_into_norm_kernel[(triton.cdiv(n, rows),)](*args, BLOCK_N=rows, **options)
    return summed, weighted


def gemv_rows(args: tuple, options: dict) -> int:
    """The weight rows per program of gemv_kernel on these launch arguments (``rows_per_program``). On
    an H200 it takes 2 rows for the Llama-3.1-8B shape's qkv_proj and LM head and 4 for its o_proj
    and down_proj, each the fastest of the three or within 0.2 µs of it (docs/performance.md)."""
    return rows_per_program(gemv_kernel, args, options, weight=args[1], out=args[3])


_rows_per_program: dict[tuple, int] = {}


def rows_per_program(kernel, args: tuple, options: dict, weight: torch.Tensor, out: torch.Tensor,
                     choices: tuple[int, ...] = GEMV_ROWS) -> int:
    """The weight rows per program (BLOCK_N) of a single-row product ``kernel`` on these launch
    arguments: of ``choices``, the one whose grid fills the GPU's resident programs best
    (``fullest_tile``), once per kernel, weight shape and dtype, output dtype and options."""
    key = (kernel.fn.__name__, tuple(weight.shape), weight.dtype, out.dtype, tuple(sorted(options.items())),
           choices, weight.device)
    if key not in _rows_per_program:
        def slots(rows):
            return resident_programs(kernel.warmup(*args, BLOCK_N=rows, grid=(1,), **options), weight.device)

        _rows_per_program[key] = fullest_tile(choices, lambda rows: triton.cdiv(weight.shape[0], rows), slots,
                                              GEMV_BLOCK_N)
    return _rows_per_program[key]


# The gated product's weight tile is gemv's default, 4 rows x 1,024 columns: 2 columns of h, each a gate and an up row.
GATED_GEMV_BLOCK_N = GEMV_BLOCK_N // 2


@triton.jit
def gated_gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, stats_ptr, intermediate, K, w_stride, eps,
                      HAS_BIAS: tl.constexpr, NORMED: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # BLOCK_N columns of h = act(gate x) * up x per program, from their gate rows and up rows
    # interleaved as one [2 * BLOCK_N, BLOCK_K] tile. The first weight tile and the bias are read
    # before waiting for the previous kernel. NORMED as gemv_kernel takes it.
    first_col = tl.program_id(0) * BLOCK_N
    weight_rows, cols = gated_weight_rows(first_col, intermediate, BLOCK_N)
    row_ok = cols < intermediate
    row_starts = w_ptr + weight_rows[:, None].to(tl.int64) * w_stride
    first_tile = weight_tile(row_starts, row_ok[:, None], tl.arange(0, BLOCK_K), K)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + weight_rows, mask=row_ok, other=0.0).to(tl.float32)
    else:
        bias = 0.0
    begin_after_previous(PDL)
    squares = norm_squares(stats_ptr) if NORMED else 0.0
    dtype = out_ptr.dtype.element_ty
    h = gated_rows_times_vector(x_ptr, row_starts, row_ok[:, None], K, first_tile, bias, squares, eps, dtype,
                                ACTIVATION, NORMED, BLOCK_N, BLOCK_K)
    h_cols = first_col + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + h_cols, h.to(dtype), mask=h_cols < intermediate)


def gated_gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str,
                      block_n: int = GATED_GEMV_BLOCK_N, block_k: int = GEMV_BLOCK_K, num_warps: int = GEMV_WARPS,
                      norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """zoo::gated_gemv's kernel; the tile arguments are for ``benchmarks/bench_gemv.py``'s sweep. ``norm``
    as ``gemv_launch`` takes it (``normed_gated_gemv_triton``)."""
    check_dtypes("gated_gemv", x, weight, *(() if bias is None else (bias,)))
    if activation not in KERNEL_ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r}; supported: {sorted(KERNEL_ACTIVATIONS)}")
    rows, k = weight.shape
    if rows % 2:
        raise ValueError(
            f"zoo::gated_gemv takes a weight of gate rows then as many up rows, got shape {tuple(weight.shape)}"
        )
    if x.numel() != k:
        raise ValueError(f"zoo::gated_gemv multiplies one row: x has shape {tuple(x.shape)} for a weight of {k} columns")
    if bias is not None and bias.shape != (rows,):
        raise ValueError(f"zoo::gated_gemv takes a bias of {rows} values for a weight of shape {tuple(weight.shape)}, "
                         f"got shape {tuple(bias.shape)}")
    intermediate = rows // 2
    weight, row = _unit_stride(weight), x.reshape(k).contiguous()
    out = torch.empty(*x.shape[:-1], intermediate, dtype=x.dtype, device=x.device)
    stats, eps = norm if norm is not None else (row, 0.0)
    gated_gemv_kernel[(triton.cdiv(intermediate, block_n),)](
        row, weight, bias_or(bias, row), out, stats, intermediate, k, weight.stride(0), float(eps),
        HAS_BIAS=bias is not None, NORMED=norm is not None, ACTIVATION=KERNEL_ACTIVATIONS[activation], BLOCK_N=block_n,
        BLOCK_K=min(block_k, triton.next_power_of_2(k)), num_warps=num_warps, **pdl_launch(x),
    )
    return out


def normed_gated_gemv_triton(weighted: torch.Tensor, stats: torch.Tensor, eps: float, weight: torch.Tensor,
                             bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """zoo::normed_gated_gemv's kernel: gated_gemv_kernel on a split norm's weighted input, its products
    times the norm's 1 / rms."""
    check_norm_stats("normed_gated_gemv", stats)
    return gated_gemv_triton(weighted, weight, bias, activation, norm=(stats, eps))


# ---------------------------------------------------------------------------------------------
# Argmax over the vocabulary
# ---------------------------------------------------------------------------------------------

ARGMAX_CHUNK = 4096


@triton.jit
def _argmax_chunks_kernel(x_ptr, values_ptr, indices_ptr, V, x_stride, num_chunks,
                          CHUNK: tl.constexpr, PDL: tl.constexpr):
    # Program (row, chunk): the chunk's largest value and its first index.
    begin_after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * x_stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    value, index = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(values_ptr + row * num_chunks + chunk, value)
    tl.store(indices_ptr + row * num_chunks + chunk, chunk * CHUNK + index)


@triton.jit
def _argmax_rows_kernel(values_ptr, indices_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    # Program per row: the first chunk holding the row's largest value holds its first index.
    begin_after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_C)
    ok = chunks < num_chunks
    values = tl.load(values_ptr + row * num_chunks + chunks, mask=ok, other=float("-inf"))
    indices = tl.load(indices_ptr + row * num_chunks + chunks, mask=ok, other=0)
    _, best = tl.max(values, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.sum(tl.where(chunks == best, indices, 0), 0))


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:
    check_dtypes("argmax", logits)
    if logits.dim() != 2:
        raise ValueError(f"zoo::argmax takes [rows, vocab] logits, got shape {tuple(logits.shape)}")
    logits = _unit_stride(logits)
    rows, vocab = logits.shape
    chunk = min(ARGMAX_CHUNK, triton.next_power_of_2(vocab))
    num_chunks = triton.cdiv(vocab, chunk)
    values = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, num_chunks, dtype=torch.int64, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    launch = pdl_launch(logits)
    _argmax_chunks_kernel[(rows, num_chunks)](
        logits, values, indices, vocab, logits.stride(0), num_chunks, CHUNK=chunk, num_warps=8, **launch,
    )
    _argmax_rows_kernel[(rows,)](
        values, indices, out, num_chunks, BLOCK_C=triton.next_power_of_2(num_chunks), num_warps=1, **launch,
    )
    return out
