"""The CUDA kernels of ``zoo::fp8_block_linear`` (``ops_cuda/fp8_linear.py``), chosen by the number of
rows (``cuda_kernel``).

A single row (batch-1 decode) takes ``fp8_block_gemv_triton``: the dequantised weight times the row,
in float32 on CUDA cores as ``zoo::gemv`` multiplies, with each scale applied to the row's group of
columns once per program rather than to every weight entry. Nothing quantises the row, so it is one
launch, and the product is the reference's but for the reference's rounding of each dequantised entry
to the activation dtype (within 2^-9 of it in bf16): the kernel multiplies by the exact dequantised
weight.

More rows have their activations quantised per token and group of ``block[1]`` columns (a Triton
kernel, ``quantise_groups``, which the FP8 fused-MoE kernel uses too), then run one of two
block-scaled FP8 GEMMs (``SCALED_MM_MIN_ROWS``):

- PyTorch's own scaled matmul, ``torch._scaled_mm`` with 1x128 activation scales and 128x128 weight
  scales (cuBLASLt's block-scaled FP8 GEMM on sm90, CUDA 12.9 onward): where the installed torch and
  device have it (``scaled_mm_available``, tried once per device), for 128x128 blocks of bf16 models;
- a Triton block-FP8 GEMM: ``tl.dot`` on float8_e4m3fn tiles with float32 accumulation, each K-step's
  product scaled by its rows' activation scales and its columns' weight-block scales; blocks whose
  columns are a multiple of 16, fp16/bf16/fp32 activations, on sm89 and later.

Anything neither takes runs the op's reference (dequantise, then matmul).

Both GEMMs compute ``sum_k q(x)[m, k] s_x[m, k // bk] * w[n, k] s_w[n // bn, k // bk]`` in float32,
rounded once to the activation dtype: the reference's product up to the activations' quantisation
(``quantised_product`` is this exact formula in PyTorch, the tests' tight oracle).
"""

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ops_cuda.dispatch import KERNEL_DTYPES
from ops_cuda.fp8 import FP8_CUDA_CAPABILITY, FP8_DTYPE, FP8_MAX, MIN_GROUP_MAX, dequantise, quantise_groups_reference
from ops_cuda.gemv import GEMV_DTYPES
from ops_cuda.triton_helpers import begin_after_previous, pdl_launch
from ops_cuda.triton_kernels import GEMV_BLOCK_K, GEMV_ROWS, GEMV_WARPS, rows_per_program

# From this many rows on, torch._scaled_mm runs the product where it can; below it, the Triton kernel.
# Set from `python3 benchmarks/bench_fp8.py --task linear` on the H200, which prints both per shape and M.
SCALED_MM_MIN_ROWS = 64
# cuBLASLt's block-scaled FP8 GEMM: 128x128 weight blocks, 1x128 activation groups.
SCALED_MM_BLOCK = (128, 128)


def quantised_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] as the FP8 kernels see it: quantised per token and group, dequantised to float32."""
    quantised, scales = quantise_groups(x, group)
    return quantised.float() * scales.repeat_interleave(group, dim=1)[:, : x.shape[1]]


def quantised_product(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """What the FP8 GEMMs compute, in float32: x [M, K] quantised per group of block[1] columns,
    times the dequantised weight. (The kernels' oracle in the tests.)"""
    return quantised_activations(x, block[1]) @ dequantise(weight, scale_inv, block).t()


# ---------------------------------------------------------------------------------------------
# Activations: per token and group
# ---------------------------------------------------------------------------------------------

QUANTISE_GROUPS_PER_PROGRAM = 8


@triton.jit
def _quantise_groups_kernel(x_ptr, q_ptr, scale_ptr, cols, x_stride, q_stride, scale_stride_m, scale_stride_g,
                            GROUP: tl.constexpr, BLOCK: tl.constexpr, GROUPS: tl.constexpr,
                            MIN_MAX: tl.constexpr, MAX: tl.constexpr):
    # Program (row, chunk): GROUPS groups of the row, each its own scale.
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    offsets = tl.arange(0, BLOCK)
    columns = groups[:, None] * GROUP + offsets[None, :]
    ok = (offsets[None, :] < GROUP) & (columns < cols)
    x = tl.load(x_ptr + row * x_stride + columns, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_MAX) / MAX
    q = tl.clamp(x / scale[:, None], -MAX, MAX)
    tl.store(q_ptr + row * q_stride + columns, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row * scale_stride_m + groups * scale_stride_g, scale, mask=groups * GROUP < cols)


def quantise_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops_cuda.fp8.quantise_groups_reference``; on CUDA by ``quantise_groups_triton``. (Triton's
    interpreter rounds to float8 wrongly, so CPU tensors, those of the interpreter tests included,
    take the reference.)"""
    return quantise_groups_triton(x, group) if x.is_cuda else quantise_groups_reference(x, group)


def quantise_groups_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops_cuda.fp8.quantise_groups_reference`` on the GPU."""
    rows, cols = x.shape
    groups = triton.cdiv(cols, group)
    if x.stride(-1) != 1:
        x = x.contiguous()
    quantised = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(groups, rows, dtype=torch.float32, device=x.device).t()
    if rows:
        _quantise_groups_kernel[(rows, triton.cdiv(groups, QUANTISE_GROUPS_PER_PROGRAM))](
            x, quantised, scales, cols, x.stride(0), quantised.stride(0), *scales.stride(),
            GROUP=group, BLOCK=triton.next_power_of_2(group), GROUPS=QUANTISE_GROUPS_PER_PROGRAM,
            MIN_MAX=MIN_GROUP_MAX, MAX=FP8_MAX, num_warps=4,
        )
    return quantised, scales


# ---------------------------------------------------------------------------------------------
# The Triton block-FP8 GEMM
# ---------------------------------------------------------------------------------------------


class GemmTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int  # at most the weight block's columns, which it divides: one scale per row and column per step
    num_warps: int
    num_stages: int


# Tile sizes by the number of rows; not tuned on the H200 yet (benchmarks/bench_fp8.py times them).
# Decode: one or a few rows; 16 (tl.dot's smallest) wastes the least, and narrow 32-column tiles spread
# the weight over as many programs as they can (N = 7168: 224 programs; N = 1536: 48).
DECODE_TILES = GemmTiles(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)
# Up to a few hundred rows; 24 KiB of A and B per stage, three stages.
MEDIUM_TILES = GemmTiles(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3)
# Prefill: 32 KiB per stage, three stages, fit the H100/H200's 228 KiB of shared memory per SM.
LARGE_TILES = GemmTiles(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)
# The interpreter (CPU tensors, tests only): the smallest tiles, so tiny shapes span several of them.
INTERPRETER_TILES = GemmTiles(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)
# Programs of GROUP_M row tiles run over the same weight columns one after another, sharing them in L2.
GROUP_M = 8


def gemm_tiles(rows: int, group_k: int, on_gpu: bool) -> GemmTiles:
    tiles = (INTERPRETER_TILES if not on_gpu else DECODE_TILES if rows <= 16
             else MEDIUM_TILES if rows <= 256 else LARGE_TILES)
    return tiles._replace(block_k=min(tiles.block_k, group_k & -group_k))  # the largest power of two dividing it


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, c_ptr, M, N, K,
    a_stride, a_scale_stride_m, a_scale_stride_g, b_stride, b_scale_stride_n, b_scale_stride_k, c_stride,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # c[m, n] = sum over K-steps of dot(a, b) * a_scale[m] * b_scale[n]; a step lies in one scale group.
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = pid // per_group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * a_stride + ks[None, :]
    b_ptrs = b_ptr + cols[None, :].to(tl.int64) * b_stride + ks[:, None]  # [BLOCK_K, BLOCK_N]: W^T's tile
    a_scale_ptrs = a_scale_ptr + rows * a_scale_stride_m
    b_scale_ptrs = b_scale_ptr + (cols // GROUP_N) * b_scale_stride_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = ks < K - k
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        group = k // GROUP_K
        a_scale = tl.load(a_scale_ptrs + group * a_scale_stride_g, mask=row_ok, other=0.0)
        b_scale = tl.load(b_scale_ptrs + group * b_scale_stride_k, mask=col_ok, other=0.0)
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * c_stride + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def triton_supported(x: torch.Tensor, weight: torch.Tensor, block) -> bool:
    """Whether ``fp8_block_gemm_triton`` takes these inputs: K-steps of at least 16 columns within one
    scale group, and a GPU with FP8 tensor cores (sm89 onward) or the interpreter."""
    return (
        x.dtype in KERNEL_DTYPES
        and weight.dim() == 2
        and block[1] % 16 == 0
        and (not x.is_cuda or _compute_capability(x.device) >= FP8_CUDA_CAPABILITY)
    )


def fp8_block_gemm_triton(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] times the FP8 block-scaled weight [N, K], plus bias: [M, N] in x's dtype."""
    rows, k = x.shape
    n = weight.shape[0]
    tiles = gemm_tiles(rows, block[1], x.is_cuda)
    quantised, scales = quantise_groups(x, block[1])
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    grid = (triton.cdiv(rows, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    _fp8_block_gemm_kernel[grid](
        quantised, scales, weight, scale_inv, out if bias is None else bias, out, rows, n, k,
        quantised.stride(0), *scales.stride(), weight.stride(0), *scale_inv.stride(), out.stride(0),
        GROUP_N=block[0], GROUP_K=block[1], HAS_BIAS=bias is not None, GROUP_M=GROUP_M,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


# ---------------------------------------------------------------------------------------------
# A single row: the dequantised weight streamed through CUDA cores
# ---------------------------------------------------------------------------------------------


@triton.jit
def _weight_groups(row_starts, row_ok, groups, K, GROUP_K: tl.constexpr):
    # [rows, groups, GROUP_K] float32: the FP8 weight's columns of scale groups `groups` (`row_starts`
    # and `row_ok` [rows, 1, 1]), read past the cache: nothing else reuses them.
    cols = groups[None, :, None] * GROUP_K + tl.arange(0, GROUP_K)[None, None, :]
    entries = tl.load(row_starts + cols, mask=row_ok & (cols < K), other=0.0, eviction_policy="evict_first")
    return entries.to(tl.float32)


@triton.jit
def _scaled_row_groups(x_ptr, scale_row, groups, K, scale_stride_k, GROUP_K: tl.constexpr):
    # [1, groups, GROUP_K] float32: the row's columns of scale groups `groups`, each times its group's
    # weight scale in the program's row block (`scale_row`), so that the weight's entries need none.
    cols = groups[None, :, None] * GROUP_K + tl.arange(0, GROUP_K)[None, None, :]
    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    scales = tl.load(scale_row + groups[None, :, None] * scale_stride_k, mask=groups[None, :, None] * GROUP_K < K,
                     other=0.0)
    return x * scales


@triton.jit
def _fp8_block_gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, N, K, w_stride,
                           scale_stride_n, scale_stride_k, GROUP_N, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # BLOCK_N weight rows per program, all in one row block of scales (BLOCK_N divides GROUP_N);
    # BLOCK_K columns (BLOCK_K / GROUP_K scale groups) per step, as a [rows, groups, GROUP_K] tile.
    # The row is scaled per group once for all the program's rows, so each weight entry costs a
    # conversion and a multiply-add. The first tile and the bias are read before waiting for the
    # previous kernel.
    GROUPS: tl.constexpr = BLOCK_K // GROUP_K
    first_row = tl.program_id(0) * BLOCK_N
    rows = first_row + tl.arange(0, BLOCK_N)
    row_ok = (rows < N)[:, None, None]
    row_starts = w_ptr + rows[:, None, None].to(tl.int64) * w_stride
    scale_row = scale_ptr + (first_row // GROUP_N) * scale_stride_n
    groups = tl.arange(0, GROUPS)
    first_tile = _weight_groups(row_starts, row_ok, groups, K, GROUP_K)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    begin_after_previous(PDL)
    acc = first_tile * _scaled_row_groups(x_ptr, scale_row, groups, K, scale_stride_k, GROUP_K)
    for start in range(BLOCK_K, K, BLOCK_K):
        step_groups = groups + start // GROUP_K
        acc += (_weight_groups(row_starts, row_ok, step_groups, K, GROUP_K)
                * _scaled_row_groups(x_ptr, scale_row, step_groups, K, scale_stride_k, GROUP_K))
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:
        out += bias
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rows < N)


def gemv_supported(x: torch.Tensor, weight: torch.Tensor, block) -> bool:
    """Whether ``fp8_block_gemv_triton`` takes these inputs: a single float16/bfloat16 row, a 2D weight
    with contiguous rows, scale blocks of rows that some of GEMV_ROWS divides and of a power-of-two
    number of columns up to a step's 1,024 (DeepSeek-V3's 128 x 128), on a GPU with FP8 conversions
    (sm89 onward) or the interpreter."""
    group = block[1]
    return (
        x.dtype in GEMV_DTYPES
        and x.numel() == x.shape[-1]
        and weight.dim() == 2
        and weight.stride(-1) == 1
        and bool(_gemv_rows_choices(block))
        and group & (group - 1) == 0
        and 16 <= group <= GEMV_BLOCK_K
        and (not x.is_cuda or _compute_capability(x.device) >= FP8_CUDA_CAPABILITY)
    )


def _gemv_rows_choices(block) -> tuple[int, ...]:
    # A program's rows share one row block of scales.
    return tuple(rows for rows in GEMV_ROWS if block[0] % rows == 0)


def fp8_block_gemv_triton(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block,
                          bias: torch.Tensor | None, rows: int | None = None) -> torch.Tensor:
    """x (one row of K) times the FP8 block-scaled weight [N, K], plus bias: [N] in x's dtype. ``rows``
    weight rows per program, a divisor of block[0]: by default ``rows_per_program``'s choice on a GPU,
    the most elsewhere."""
    n, k = weight.shape
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    row = x.reshape(k).contiguous()
    args = (row, weight, scale_inv, row if bias is None else bias.contiguous(), out, n, k, weight.stride(0),
            *scale_inv.stride(), block[0])
    options = dict(GROUP_K=block[1], HAS_BIAS=bias is not None,
                   BLOCK_K=max(block[1], min(GEMV_BLOCK_K, triton.next_power_of_2(k))), num_warps=GEMV_WARPS,
                   **pdl_launch(x))
    if rows is None:
        choices = _gemv_rows_choices(block)
        rows = (rows_per_program(_fp8_block_gemv_kernel, args, options, weight, out, choices) if x.is_cuda
                else max(choices))
    if block[0] % rows:
        raise ValueError(f"fp8_block_gemv_triton: {rows} rows per program straddle row blocks of {block[0]}")
    _fp8_block_gemv_kernel[(triton.cdiv(n, rows),)](*args, BLOCK_N=rows, **options)
    return out


# ---------------------------------------------------------------------------------------------
# PyTorch's block-scaled FP8 GEMM
# ---------------------------------------------------------------------------------------------


def fp8_block_gemm_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                             bias: torch.Tensor | None) -> torch.Tensor:
    """``fp8_block_gemm_triton`` by ``torch._scaled_mm``: x [M, K] with 1x128 scales (column-major, as
    cuBLASLt reads them), the weight [N, K] as the column-major [K, N] operand with its 128x128 scales
    transposed to [K / 128, N / 128]."""
    rows = x.shape[0]
    # cuBLASLt's block-scaled FP8 GEMM takes rows in multiples of 4 only (measured on the H200 with
    # torch 2.11 / CUDA 13: 65 rows fail, 68 run): zero rows pad the others.
    padded = F.pad(x, (0, 0, 0, -rows % 4)) if rows % 4 else x
    quantised, scales = quantise_groups(padded, SCALED_MM_BLOCK[1])
    out = torch._scaled_mm(quantised, weight.t(), scale_a=scales, scale_b=scale_inv.t(), out_dtype=x.dtype)[:rows]
    return out if bias is None else out + bias


def scaled_mm_supported(x: torch.Tensor, weight: torch.Tensor, block) -> bool:
    """Whether ``fp8_block_gemm_scaled_mm`` takes these inputs: 128x128 blocks, bf16 activations, whole
    blocks in N and K with K / 128 a multiple of 4 (cuBLASLt's layout of the scales), a contiguous
    weight, on a device where the block-scaled ``torch._scaled_mm`` runs."""
    n, k = weight.shape
    return (
        tuple(block) == SCALED_MM_BLOCK
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and n % 128 == 0
        and k % 512 == 0
        and weight.is_contiguous()
        and scaled_mm_available(x.device)
    )


@functools.cache
def scaled_mm_available(device: torch.device) -> bool:
    """Whether this torch's ``torch._scaled_mm`` multiplies with 1x128 and 128x128 block scales on
    ``device`` (torch 2.9 onward, sm90, cuBLASLt 12.9 onward): tried once on a small product with
    random scales, and checked against ``quantised_product``."""
    if _compute_capability(device)[0] != 9:
        return False
    generator = torch.Generator(device).manual_seed(0)
    x = torch.randn(32, 512, generator=generator, device=device).to(torch.bfloat16)
    weight = torch.randn(256, 512, generator=generator, device=device).to(FP8_DTYPE)
    scale_inv = torch.rand(2, 4, generator=generator, device=device) + 0.5
    try:
        out = fp8_block_gemm_scaled_mm(x, weight, scale_inv, None).float()
    except RuntimeError:  # no block-scaled kernel in this torch or cuBLASLt
        return False
    expected = quantised_product(x, weight, scale_inv, SCALED_MM_BLOCK)
    return bool(((out - expected).abs().max() <= 0.01 * expected.abs().max()).item())


@functools.cache
def _compute_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


# ---------------------------------------------------------------------------------------------
# The op's choice
# ---------------------------------------------------------------------------------------------


def cuda_kernel(x: torch.Tensor, weight: torch.Tensor, block) -> str:
    """Which kernel the op's CUDA dispatch runs on these inputs: "gemv", "scaled_mm", "triton" or "reference"."""
    if gemv_supported(x, weight, block):
        return "gemv"
    rows = x.numel() // x.shape[-1]
    if rows >= SCALED_MM_MIN_ROWS and scaled_mm_supported(x, weight, block):
        return "scaled_mm"
    if triton_supported(x, weight, block):
        return "triton"
    return "reference"
