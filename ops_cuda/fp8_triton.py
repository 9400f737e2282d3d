"""The CUDA kernels of ``zoo::fp8_block_linear`` (``ops_cuda/fp8_linear.py``): activations quantised
per token and group of ``block[1]`` columns (a Triton kernel, ``quantise_groups``, which the FP8
fused-MoE kernel uses too), then one of two block-scaled FP8 GEMMs, chosen by the number of rows
(``SCALED_MM_MIN_ROWS``, ``cuda_kernel``):

- PyTorch's own scaled matmul, ``torch._scaled_mm`` with 1x128 activation scales and 128x128 weight
  scales (cuBLASLt's block-scaled FP8 GEMM on sm90, CUDA 12.9 onward): where the installed torch and
  device have it (``scaled_mm_available``, tried once per device), for 128x128 blocks of bf16 models;
- a Triton block-FP8 GEMM: ``tl.dot`` on float8_e4m3fn tiles with float32 accumulation, each K-step's
  product scaled by its rows' activation scales and its columns' weight-block scales; any block of at
  least 16 columns, fp16/bf16/fp32 activations, on sm89 and later.

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
    if not hasattr(torch, "_scaled_mm") or _compute_capability(device)[0] != 9:
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
    """Which GEMM the op's CUDA dispatch runs on these inputs: "scaled_mm", "triton" or "reference"."""
    rows = x.numel() // x.shape[-1]
    if rows >= SCALED_MM_MIN_ROWS and scaled_mm_supported(x, weight, block):
        return "scaled_mm"
    if triton_supported(x, weight, block):
        return "triton"
    return "reference"
