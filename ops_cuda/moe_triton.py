"""The Triton fused-MoE kernel of ``zoo::moe_experts``: each expert's rows in blocks of BLOCK_M, each
block one tiled GEMM against its expert's weights only, so a decode step reads the weights of the experts
its tokens picked and nothing else (the grouped GEMM of ``moe_grouped_mm.py`` runs 64-row tiles over
every group). The idea is vLLM's ``fused_moe``; the code is zoo's own.

    order, offsets = sort_pairs_by_expert(topk_ids, E)   # shared with the grouped-GEMM kernel
    align:   each expert's run of pairs padded to a multiple of BLOCK_M rows; per row the pair it
             holds (or "none"), per block its expert (or "none"), per pair the row it landed on
             (one token: a block per pair, in slot order, one launch and no sort)
    gate_up: h[row] = act(gate_e x) * up_e x, x the hidden row of the row's token   [rows, I]
    down:    y[row] = down_e h[row]                                                  [rows, H]
    combine: out[t] = sum_k w[t, k] * y[row of (t, k)], float32, k in order
             (moe_grouped_mm.moe_combine)

A pair of id -1 (an expert on another rank) sorts after every expert's run, gets no row and adds
nothing to the combine.

A shared expert every token takes (DeepSeek's, ``SharedExpert``) can ride along: one more pair per
token, numbered after the routed pairs, whose run the align lays out after every routed expert's
and whose weights the kernels read from its own tensors; the combine adds its output, unweighted, to
the routed sum rounded to the activation dtype. At a few tokens this saves the shared expert's own
launches (``zoo::fp8_moe_experts`` takes it up to ``SHARED_IN_LAUNCH_MAX_TOKENS``).

The buffers are sized for the worst case, P pairs on min(E, P) experts each padding up to BLOCK_M - 1
rows, so every shape and grid depends on P only and nothing is read back to the host: the op runs
under CUDA-graph capture as it runs eagerly. Programs of blocks no expert needed return at once.

Numerics follow the reference: both GEMMs accumulate in float32 and round to the activation dtype, as
``F.linear`` does, an expert's bias (where the experts have biases; HAS_BIAS) added before the rounding;
the activation-and-mul epilogue is the ``act_and_mul`` kernel's formula and rounding
(``triton_helpers.store_gated_activation``). float32 inputs multiply in full float32 (``input_precision="ieee"``).

FP8 block-scaled experts (``zoo::fp8_moe_experts``, ``Fp8Scales``): the same kernels read float8_e4m3fn
weights and activations quantised per token and group of ``block[1]`` columns (the hidden rows before
gate_up, h before down), each K-step's product scaled by its rows' activation scales and its columns'
weight-block scales, so a step stays within one scale group (BLOCK_K divides ``block[1]``).

MXFP4 experts (``zoo::mxfp4_moe_experts``, ``Mxfp4Scales``): the kernels read uint8 blocks, two 4-bit
values a byte, and a scale per 32 values (``ops_cuda/mxfp4.py``). Each K-step's weight tile arrives as
[BLOCK_N, BLOCK_K / 8] int32 words of eight values with [BLOCK_N, BLOCK_K / 32] scales, dequantised in
registers to the activation dtype (exactly: ``ops_cuda/mxfp4_triton.py``) and joined back into one
tile in the columns' order: one product a step, as for bf16 weights. BLOCK_K is a multiple of the
32-value groups.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ops_cuda.dispatch import KERNEL_DTYPES
from ops_cuda.fp8 import FP8_CUDA_CAPABILITY, FP8_DTYPE
from ops_cuda.fp8_triton import quantise_groups
from ops_cuda.moe_grouped_mm import moe_combine, sort_pairs_by_expert
from ops_cuda.mxfp4 import GROUP_SIZE as MXFP4_GROUP_SIZE
from ops_cuda.mxfp4_triton import mxfp4_step_product
from ops_cuda.triton_helpers import (
    KERNEL_ACTIVATIONS,
    bias_or,
    expert_bias,
    gate_up_tile_products,
    store_gated_activation,
    tile_products,
)


class Tiles(NamedTuple):
    block_m: int  # rows per block: one expert's tokens; a block with fewer is padded
    block_n: int  # output columns per program (the gate_up kernel reads 2 * block_n weight rows)
    block_k: int  # reduction step
    num_warps: int
    num_stages: int


# Decode and small batches, the experts with a few rows each: 16 rows (tl.dot's smallest) wastes the
# least on padding, and narrow N tiles spread one expert's weights over many programs, so a handful of
# experts still keeps every SM streaming weights (I=768: 24 gate_up and 64 down programs per block).
SMALL_TILES = Tiles(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=3)
# Prefill, tens of rows or more per expert: each weight tile is reused over 64 rows. Shared memory per
# stage (8 KiB of rows + 16 KiB of gate and up weights in bf16) fits three stages on any sm80+ GPU;
# float32 halves block_k to stay within the same bytes.
LARGE_TILES = Tiles(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)
# The interpreter (CPU tensors, tests only): the smallest tiles, so tiny shapes span several of them.
INTERPRETER_TILES = {tiles: tiles._replace(block_n=16, block_k=16) for tiles in (SMALL_TILES, LARGE_TILES)}
# Small tiles while the average expert's rows fill at most one small block.
SMALL_TILES_MAX_ROWS_PER_EXPERT = SMALL_TILES.block_m


class Fp8Scales(NamedTuple):
    """The float32 block scales of FP8 experts: gate_up's [E, ceil(2I / rows), ceil(H / cols)] and
    down's [E, ceil(H / rows), ceil(I / cols)], ``block`` = (rows, cols)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    block: tuple[int, int]


class Mxfp4Scales(NamedTuple):
    """The uint8 group scales of MXFP4 experts, gate_up's [E, 2I, H / 32] and down's [E, H, I / 32], whose
    weights are then their uint8 blocks, gate_up [E, 2I, H / 2] and down [E, H, I / 2]."""

    gate_up: torch.Tensor
    down: torch.Tensor


class SharedExpert(NamedTuple):
    """An ungated expert every token takes (DeepSeek's ``shared_experts``), run as one more pair per token
    of weight 1, added to the routed experts' sum once that is rounded to the activation dtype (as the
    model adds the shared expert's output): ``gate_up`` [2I, H] and ``down`` [H, I] laid out as one
    expert of the stack (``shared_supported``), with FP8 scales where the experts have them."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None


def tiles_for(hidden: torch.Tensor, num_pairs: int, num_experts: int, fp8: Fp8Scales | None = None,
              mxfp4: bool = False) -> Tiles:
    tiles = SMALL_TILES if num_pairs <= SMALL_TILES_MAX_ROWS_PER_EXPERT * num_experts else LARGE_TILES
    if not hidden.is_cuda:
        tiles = INTERPRETER_TILES[tiles]
    elif hidden.dtype == torch.float32 and fp8 is None:
        tiles = tiles._replace(block_k=tiles.block_k // 2)
    if fp8 is not None:  # a K-step within one scale group: the largest power of two dividing its columns
        tiles = tiles._replace(block_k=min(tiles.block_k, fp8.block[1] & -fp8.block[1]))
    if mxfp4:  # whole scale groups a K-step
        tiles = tiles._replace(block_k=max(tiles.block_k, MXFP4_GROUP_SIZE))
    return tiles


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks the padded layout can need: at most min(E, P) experts have pairs, each padding its run up
    to a multiple of block_m, so sum ceil(count / block_m) <= (P + min(E, P) * (block_m - 1)) / block_m."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def triton_supported(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, activation: str,
                     fp8: Fp8Scales | None = None) -> bool:
    """Whether ``moe_experts_triton`` takes these inputs (else the op runs its PyTorch reference). FP8
    experts need K-steps of at least 16 columns within a scale group and, on a GPU, FP8 tensor cores
    (sm89 onward)."""
    if fp8 is not None:
        on_fp8_device = not hidden.is_cuda or torch.cuda.get_device_capability(hidden.device) >= FP8_CUDA_CAPABILITY
        weights_ok = gate_up.dtype == down.dtype == FP8_DTYPE and fp8.block[1] % 16 == 0 and on_fp8_device
    else:
        weights_ok = hidden.dtype == gate_up.dtype == down.dtype
    return (
        weights_ok
        and hidden.dtype in KERNEL_DTYPES
        and activation in KERNEL_ACTIVATIONS
        and hidden.dim() == 2
        and gate_up.shape[2] == down.shape[1] == hidden.shape[1]
        and gate_up.shape[1] == 2 * down.shape[2]
        and gate_up.shape[0] == down.shape[0]
    )


def mxfp4_triton_supported(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, activation: str,
                           scales: Mxfp4Scales) -> bool:
    """Whether ``moe_experts_triton`` takes MXFP4 experts (uint8 blocks ``gate_up`` and ``down``, checked
    against their scales by the op) for these inputs: H and I whole scale groups, rows contiguous."""
    hidden_size, intermediate = hidden.shape[-1], 2 * down.shape[2]
    return (
        hidden.dtype in KERNEL_DTYPES
        and activation in KERNEL_ACTIVATIONS
        and hidden.dim() == 2
        and hidden_size % MXFP4_GROUP_SIZE == 0
        and intermediate % MXFP4_GROUP_SIZE == 0
        and 2 * gate_up.shape[2] == down.shape[1] == hidden_size
        and gate_up.shape[1] == 2 * intermediate
        and gate_up.shape[0] == down.shape[0] == scales.gate_up.shape[0] == scales.down.shape[0]
        and gate_up.stride(-1) == down.stride(-1) == 1  # rows of whole int32 words for one token's kernels
        and gate_up.data_ptr() % 4 == down.data_ptr() % 4 == 0
    )


def shared_supported(shared: SharedExpert, gate_up: torch.Tensor, down: torch.Tensor,
                     fp8: Fp8Scales | None = None) -> bool:
    """Whether the kernels can read ``shared`` as one more expert of the stack: each of its tensors of
    the dtype, shape and strides of one expert's (scales too)."""
    pairs = [(shared.gate_up, gate_up), (shared.down, down)]
    if fp8 is not None:
        if shared.gate_up_scale is None or shared.down_scale is None:
            return False
        pairs += [(shared.gate_up_scale, fp8.gate_up), (shared.down_scale, fp8.down)]
    return all(one.dtype == stack.dtype and one.shape == stack.shape[1:] and one.stride() == stack.stride()[1:]
               for one, stack in pairs)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _moe_align_kernel(
    offsets_ptr, order_ptr, row_pair_ptr, pair_row_ptr, block_expert_ptr, num_experts, num_pairs, num_blocks,
    routed_pairs, num_tokens, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, SHARED: tl.constexpr,
):
    # Program e < E lays out expert e's rows; program E lays out the shared expert's (with SHARED: one
    # pair per token, numbered from routed_pairs on, after every routed expert's run) and marks the
    # blocks after the last run as unused. Every program recomputes the padded run lengths from the E
    # offsets (a few hundred values) rather than waiting on a prefix sum from another launch.
    expert = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    ends = tl.load(offsets_ptr + experts, mask=experts < num_experts, other=0)
    starts = tl.load(offsets_ptr + experts - 1, mask=(experts > 0) & (experts < num_experts), other=0)
    counts = ends - starts
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    first_row = tl.sum(tl.where(experts < expert, padded, 0))  # for program E: all the routed rows
    if expert < num_experts:
        start = tl.sum(tl.where(experts == expert, starts, 0))
        count = tl.sum(tl.where(experts == expert, counts, 0))
        _lay_out_run(order_ptr + start, count, first_row, expert, row_pair_ptr, pair_row_ptr, block_expert_ptr,
                     num_pairs, 0, BLOCK_M, False)
    else:
        if SHARED:
            _lay_out_run(order_ptr, num_tokens, first_row, num_experts, row_pair_ptr, pair_row_ptr,
                         block_expert_ptr, num_pairs, routed_pairs, BLOCK_M, True)
            first_row += (num_tokens + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        for first_block in range(first_row // BLOCK_M, num_blocks, BLOCK_E):
            blocks = first_block + tl.arange(0, BLOCK_E)
            tl.store(block_expert_ptr + blocks, tl.full([BLOCK_E], -1, tl.int32), mask=blocks < num_blocks)


@triton.jit
def _one_token_layout_kernel(ids_ptr, row_pair_ptr, pair_row_ptr, block_expert_ptr, top_k, num_experts, num_pairs,
                             BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, SHARED: tl.constexpr):
    # One token: each pair is its expert's whole run, so pair p (slot p; with SHARED, pair top_k is the
    # shared expert's) is the first row of block p and the ids need no sort. A pair of id -1 (another
    # rank's expert) leaves its block unused.
    pairs = tl.arange(0, BLOCK_P)
    in_use = pairs < num_pairs
    experts = tl.load(ids_ptr + pairs, mask=pairs < top_k, other=-1)
    if SHARED:
        experts = tl.where(pairs == top_k, num_experts, experts)
    tl.store(block_expert_ptr + pairs, experts.to(tl.int32), mask=in_use)
    tl.store(pair_row_ptr + pairs, (pairs * BLOCK_M).to(tl.int32), mask=in_use & (experts >= 0))
    rows = tl.arange(0, BLOCK_M)
    row_pairs = tl.where(rows[None, :] == 0, pairs[:, None], num_pairs)  # num_pairs: padding
    tl.store(row_pair_ptr + pairs[:, None] * BLOCK_M + rows[None, :], row_pairs.to(tl.int32), mask=in_use[:, None])


@triton.jit
def _lay_out_run(run_order_ptr, count, first_row, expert, row_pair_ptr, pair_row_ptr, block_expert_ptr, num_pairs,
                 first_pair, BLOCK_M: tl.constexpr, CONSECUTIVE: tl.constexpr):
    # One expert's run of count pairs from first_row on, padded to whole blocks: the pairs in
    # run_order_ptr's order, or with CONSECUTIVE the pairs first_pair, first_pair + 1, ...
    for offset in range(0, count, BLOCK_M):
        rows = offset + tl.arange(0, BLOCK_M)
        holds_pair = rows < count
        if CONSECUTIVE:
            pairs = tl.where(holds_pair, first_pair + rows, num_pairs)
        else:
            pairs = tl.load(run_order_ptr + rows, mask=holds_pair, other=num_pairs)  # num_pairs: padding
        tl.store(row_pair_ptr + first_row + rows, pairs.to(tl.int32))
        tl.store(pair_row_ptr + pairs, (first_row + rows).to(tl.int32), mask=holds_pair)
        tl.store(block_expert_ptr + (first_row + offset) // BLOCK_M, expert)


@triton.jit
def _scale_groups(x_scale_ptrs, w_scale_ptrs, row_ok, col_ok, k, x_scale_stride_g, w_scale_stride_k,
                  GROUP_K: tl.constexpr):
    # The K-step at k lies in one scale group: its rows' activation scales and its columns' weight scales.
    group = k // GROUP_K
    x_scale = tl.load(x_scale_ptrs + group * x_scale_stride_g, mask=row_ok, other=0.0)
    w_scale = tl.load(w_scale_ptrs + group * w_scale_stride_k, mask=col_ok, other=0.0)
    return x_scale[:, None] * w_scale[None, :]


@triton.jit
def _expert_weights(expert, w_ptr, w_scale_ptr, w_stride_e, w_scale_stride_e, shared_ptr, shared_scale_ptr,
                    num_experts, SHARED: tl.constexpr):
    # Where an expert's weights and scales start; with SHARED, id num_experts is the shared expert,
    # held in tensors of its own laid out as one expert of the stack.
    weights = w_ptr + expert * w_stride_e
    scales = w_scale_ptr + expert * w_scale_stride_e
    if SHARED:
        is_shared = expert == num_experts
        weights = tl.where(is_shared, shared_ptr, weights)
        scales = tl.where(is_shared, shared_scale_ptr, scales)
    return weights, scales


@triton.jit
def _moe_gate_up_kernel(
    hidden_ptr, gate_up_ptr, bias_ptr, row_pair_ptr, block_expert_ptr, h_ptr,
    num_pairs, hidden_size, intermediate,
    hidden_stride, w_stride_e, w_stride_n, w_stride_k, h_stride,
    hidden_scale_ptr, w_scale_ptr, hidden_scale_stride_m, hidden_scale_stride_g,
    w_scale_stride_e, w_scale_stride_n, w_scale_stride_k,
    shared_ptr, shared_scale_ptr, num_experts, routed_pairs,
    TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, SHARED: tl.constexpr, HAS_BIAS: tl.constexpr,
    MXFP4: tl.constexpr,
):
    # Program (block, n): columns n*BLOCK_N.. of h for the block's rows: the gate and up tiles side by
    # side over the hidden size, then act(gate) * up, each rounded where the reference rounds. With
    # FP8 the hidden rows and weights are float8 and each step's products are scaled (the scale
    # pointers and GROUP_* are read only then); with MXFP4 the weights are blocks and their scales.
    block = tl.program_id(0).to(tl.int64)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    weights, weight_scales = _expert_weights(expert, gate_up_ptr, w_scale_ptr, w_stride_e, w_scale_stride_e,
                                             shared_ptr, shared_scale_ptr, num_experts, SHARED)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(row_pair_ptr + rows)
    row_ok = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    if SHARED:  # the shared expert's pairs follow the routed ones, one per token
        tokens = tl.where(pairs < routed_pairs, tokens, pairs - routed_pairs)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < intermediate
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = hidden_ptr + tokens[:, None] * hidden_stride + ks[None, :]
    # [BLOCK_K, BLOCK_N] tiles of the expert's gate rows and of its up rows (I rows further), transposed.
    gate_ptrs = weights + cols[None, :] * w_stride_n + ks[:, None] * w_stride_k
    up_ptrs = gate_ptrs + intermediate * w_stride_n
    x_scale_ptrs = hidden_scale_ptr + tokens * hidden_scale_stride_m
    gate_scale_ptrs = weight_scales + (cols // GROUP_N) * w_scale_stride_n
    up_scale_ptrs = weight_scales + ((cols + intermediate) // GROUP_N) * w_scale_stride_n
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MXFP4:
        gate, up = _mxfp4_gate_up(hidden_ptr, tokens, row_ok, weights, weight_scales, cols, col_ok, hidden_size,
                                  intermediate, hidden_stride, w_stride_n, w_stride_k, w_scale_stride_n,
                                  w_scale_stride_k, gate, up, DOT_PRECISION, BLOCK_N, BLOCK_K)
    elif FP8:
        for k in range(0, hidden_size, BLOCK_K):
            k_ok = ks < hidden_size - k
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = k_ok[:, None] & col_ok[None, :]
            gate += tl.dot(x, tl.load(gate_ptrs, mask=w_ok, other=0.0)) * _scale_groups(
                x_scale_ptrs, gate_scale_ptrs, row_ok, col_ok, k, hidden_scale_stride_g, w_scale_stride_k, GROUP_K)
            up += tl.dot(x, tl.load(up_ptrs, mask=w_ok, other=0.0)) * _scale_groups(
                x_scale_ptrs, up_scale_ptrs, row_ok, col_ok, k, hidden_scale_stride_g, w_scale_stride_k, GROUP_K)
            x_ptrs += BLOCK_K
            gate_ptrs += BLOCK_K * w_stride_k
            up_ptrs += BLOCK_K * w_stride_k
    else:
        gate, up = gate_up_tile_products(x_ptrs, gate_ptrs, up_ptrs, row_ok, col_ok, hidden_size, w_stride_k, gate, up,
                                         DOT_PRECISION, BLOCK_K)
    store_gated_activation(h_ptr + rows[:, None] * h_stride + cols[None, :], row_ok[:, None] & col_ok[None, :],
                           gate, up, bias_ptr, expert, cols, col_ok, intermediate, HAS_BIAS, ACTIVATION)


@triton.jit
def _mxfp4_gate_up(hidden_ptr, tokens, row_ok, weights, weight_scales, cols, col_ok, hidden_size, intermediate,
                   hidden_stride, w_stride_n, w_stride_k, w_scale_stride_n, w_scale_stride_k, gate, up,
                   DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # The gate and up products over MXFP4 weights (`weights` and strides in int32 words), a K-step at a
    # time (mxfp4_step_product).
    ks, words_in_step, groups = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_K // 8), tl.arange(0, BLOCK_K // 32)
    x_ptrs = hidden_ptr + tokens[:, None] * hidden_stride + ks[None, :]
    gate_ptrs = weights + cols[:, None] * w_stride_n + words_in_step[None, :] * w_stride_k
    up_ptrs = gate_ptrs + intermediate * w_stride_n
    gate_scale_ptrs = weight_scales + cols[:, None] * w_scale_stride_n + groups[None, :] * w_scale_stride_k
    up_scale_ptrs = gate_scale_ptrs + intermediate * w_scale_stride_n
    for k in range(0, hidden_size, BLOCK_K):
        x = tl.load(x_ptrs, mask=row_ok[:, None] & (ks < hidden_size - k)[None, :], other=0.0)
        w_ok = col_ok[:, None] & (8 * words_in_step < hidden_size - k)[None, :]
        scale_ok = col_ok[:, None] & (groups < (hidden_size - k) // 32)[None, :]
        gate = mxfp4_step_product(x, gate_ptrs, gate_scale_ptrs, w_ok, scale_ok, gate, DOT_PRECISION, BLOCK_K,
                                  BLOCK_N)
        up = mxfp4_step_product(x, up_ptrs, up_scale_ptrs, w_ok, scale_ok, up, DOT_PRECISION, BLOCK_K, BLOCK_N)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K // 8 * w_stride_k
        up_ptrs += BLOCK_K // 8 * w_stride_k
        gate_scale_ptrs += BLOCK_K // 32 * w_scale_stride_k
        up_scale_ptrs += BLOCK_K // 32 * w_scale_stride_k
    return gate, up


@triton.jit
def _mxfp4_down(h_ptr, rows, row_ok, weights, weight_scales, cols, col_ok, intermediate, h_stride, w_stride_n,
                w_stride_k, w_scale_stride_n, w_scale_stride_k, acc, DOT_PRECISION: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # The down product over MXFP4 weights, as _mxfp4_gate_up.
    ks, words_in_step, groups = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_K // 8), tl.arange(0, BLOCK_K // 32)
    h_ptrs = h_ptr + rows[:, None] * h_stride + ks[None, :]
    w_ptrs = weights + cols[:, None] * w_stride_n + words_in_step[None, :] * w_stride_k
    scale_ptrs = weight_scales + cols[:, None] * w_scale_stride_n + groups[None, :] * w_scale_stride_k
    for k in range(0, intermediate, BLOCK_K):
        h = tl.load(h_ptrs, mask=row_ok[:, None] & (ks < intermediate - k)[None, :], other=0.0)
        w_ok = col_ok[:, None] & (8 * words_in_step < intermediate - k)[None, :]
        scale_ok = col_ok[:, None] & (groups < (intermediate - k) // 32)[None, :]
        acc = mxfp4_step_product(h, w_ptrs, scale_ptrs, w_ok, scale_ok, acc, DOT_PRECISION, BLOCK_K, BLOCK_N)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 8 * w_stride_k
        scale_ptrs += BLOCK_K // 32 * w_scale_stride_k
    return acc


@triton.jit
def _moe_down_kernel(
    h_ptr, down_ptr, bias_ptr, row_pair_ptr, block_expert_ptr, y_ptr,
    num_pairs, hidden_size, intermediate,
    h_stride, w_stride_e, w_stride_n, w_stride_k, y_stride,
    h_scale_ptr, w_scale_ptr, h_scale_stride_m, h_scale_stride_g,
    w_scale_stride_e, w_scale_stride_n, w_scale_stride_k,
    shared_ptr, shared_scale_ptr, num_experts,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, SHARED: tl.constexpr, HAS_BIAS: tl.constexpr,
    MXFP4: tl.constexpr,
):
    # Program (block, n): columns n*BLOCK_N.. of y = h down_e^T for the block's rows. Padding rows of h
    # were never written: they are read as zeros and their outputs not stored.
    block = tl.program_id(0).to(tl.int64)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    weights, weight_scales = _expert_weights(expert, down_ptr, w_scale_ptr, w_stride_e, w_scale_stride_e,
                                             shared_ptr, shared_scale_ptr, num_experts, SHARED)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = tl.load(row_pair_ptr + rows) < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden_size
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None] * h_stride + ks[None, :]
    w_ptrs = weights + cols[None, :] * w_stride_n + ks[:, None] * w_stride_k
    h_scale_ptrs = h_scale_ptr + rows * h_scale_stride_m
    w_scale_ptrs = weight_scales + (cols // GROUP_N) * w_scale_stride_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MXFP4:
        acc = _mxfp4_down(h_ptr, rows, row_ok, weights, weight_scales, cols, col_ok, intermediate, h_stride,
                          w_stride_n, w_stride_k, w_scale_stride_n, w_scale_stride_k, acc, DOT_PRECISION, BLOCK_N,
                          BLOCK_K)
    elif FP8:
        for k in range(0, intermediate, BLOCK_K):
            k_ok = ks < intermediate - k
            h = tl.load(h_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc += tl.dot(h, w) * _scale_groups(h_scale_ptrs, w_scale_ptrs, row_ok, col_ok, k, h_scale_stride_g,
                                                w_scale_stride_k, GROUP_K)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * w_stride_k
    else:
        acc = tile_products(h_ptrs, w_ptrs, row_ok, col_ok, intermediate, w_stride_k, acc, DOT_PRECISION, BLOCK_K)
    if HAS_BIAS:
        acc += expert_bias(bias_ptr, expert, cols, col_ok, hidden_size)[None, :]
    out = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


class Layout(NamedTuple):
    row_pair: torch.Tensor  # [blocks * block_m] int32: the pair each row holds, num_pairs for padding
    pair_row: torch.Tensor  # [P] int32: the row each pair landed on (unwritten for a pair of id -1)
    block_expert: torch.Tensor  # [blocks] int32: each block's expert, -1 for unused blocks


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, shared: bool = False) -> Layout:
    """The (token, slot) pairs in expert order, each expert's run padded to a multiple of block_m rows.
    With ``shared``, one more pair per token (numbered after the routed pairs) for expert ``num_experts``,
    whose run comes last. One token's pairs need no sort: block p holds pair p, in slot order."""
    routed_pairs, num_tokens = topk_ids.numel(), topk_ids.shape[0] if shared else 0
    num_pairs = routed_pairs + num_tokens
    num_blocks = max_blocks(num_pairs, num_experts + shared, block_m)
    device = topk_ids.device
    layout = Layout(
        row_pair=torch.empty(num_blocks * block_m, dtype=torch.int32, device=device),
        pair_row=torch.empty(num_pairs, dtype=torch.int32, device=device),
        block_expert=torch.empty(num_blocks, dtype=torch.int32, device=device),
    )
    if topk_ids.shape[0] == 1:  # a block per pair (num_blocks == num_pairs): one launch, no sort
        _one_token_layout_kernel[(1,)](
            topk_ids.reshape(-1).contiguous(), *layout, routed_pairs, num_experts, num_pairs,
            BLOCK_M=block_m, BLOCK_P=triton.next_power_of_2(num_pairs), SHARED=shared, num_warps=1,
        )
        return layout
    order, offsets = sort_pairs_by_expert(topk_ids, num_experts)
    _moe_align_kernel[(num_experts + 1,)](
        offsets, order, *layout, num_experts, num_pairs, num_blocks, routed_pairs, num_tokens,
        BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts), SHARED=shared, num_warps=4,
    )
    return layout


def moe_experts_triton(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    fp8: Fp8Scales | None = None,
    shared: SharedExpert | None = None,
    mxfp4: Mxfp4Scales | None = None,
) -> torch.Tensor:
    """``zoo::moe_experts`` with the fused-MoE kernels, with ``fp8`` scales ``zoo::fp8_moe_experts``, with
    ``mxfp4`` scales ``zoo::mxfp4_moe_experts`` (``gate_up`` and ``down`` their blocks);
    with ``shared``, plus that expert for every token; the caller checks ``triton_supported`` first (and
    the biases' dtype and shape). Biases are the routed experts' only: not taken with ``shared``."""
    if shared is not None and (gate_up_bias is not None or down_bias is not None):
        raise ValueError("moe_experts_triton: the shared expert has no bias, and its id would read past the experts'")
    num_tokens, hidden_size = hidden.shape
    num_experts, intermediate = gate_up.shape[0], down.shape[2] * (2 if mxfp4 is not None else 1)
    if mxfp4 is not None:  # the kernels read the blocks as int32 words of eight values
        gate_up, down = gate_up.view(torch.int32), down.view(torch.int32)
    if num_tokens == 0:  # a static shape: no launch has anything to do
        return hidden.new_zeros(num_tokens, hidden_size)
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    top_k, routed_pairs = topk_ids.shape[1], topk_ids.numel()
    num_pairs = routed_pairs + (num_tokens if shared is not None else 0)  # the shared expert's: one per token
    tiles = tiles_for(hidden, num_pairs, num_experts + (shared is not None), fp8, mxfp4 is not None)
    layout = moe_align(topk_ids, num_experts, tiles.block_m, shared is not None)
    num_blocks, rows = layout.block_expert.shape[0], layout.row_pair.shape[0]
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"  # only float32 operands read it
    launch = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT_PRECISION=precision,
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages, FP8=fp8 is not None,
                  GROUP_N=fp8.block[0] if fp8 else 1, GROUP_K=fp8.block[1] if fp8 else 1, SHARED=shared is not None,
                  MXFP4=mxfp4 is not None)

    x, x_scales = quantise_groups(hidden, fp8.block[1]) if fp8 else (hidden, hidden)
    h = torch.empty(rows, intermediate, dtype=hidden.dtype, device=hidden.device)
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(intermediate, tiles.block_n))](
        x, gate_up, bias_or(gate_up_bias, gate_up), layout.row_pair, layout.block_expert, h,
        num_pairs, hidden_size, intermediate,
        x.stride(0), *gate_up.stride(), h.stride(0),
        *_scale_arguments(x_scales, fp8.gate_up if fp8 else mxfp4.gate_up if mxfp4 else None),
        *_shared_arguments(shared, "gate_up", x_scales, gate_up, num_experts), routed_pairs,
        TOP_K=top_k, ACTIVATION=KERNEL_ACTIVATIONS[activation], HAS_BIAS=gate_up_bias is not None, **launch,
    )
    # Padding rows of h were never written: their quantised rows and scales are never read.
    h_in, h_scales = quantise_groups(h, fp8.block[1]) if fp8 else (h, h)
    y = torch.empty(rows, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden_size, tiles.block_n))](
        h_in, down, bias_or(down_bias, down), layout.row_pair, layout.block_expert, y,
        num_pairs, hidden_size, intermediate,
        h_in.stride(0), *down.stride(), y.stride(0),
        *_scale_arguments(h_scales, fp8.down if fp8 else mxfp4.down if mxfp4 else None),
        *_shared_arguments(shared, "down", h_scales, down, num_experts), HAS_BIAS=down_bias is not None, **launch,
    )
    return moe_combine(y, layout.pair_row, topk_weights, topk_ids, hidden.dtype, shared=shared is not None)


def _shared_arguments(shared: SharedExpert | None, name: str, x_scales: torch.Tensor, experts: torch.Tensor,
                      num_experts: int) -> tuple:
    """The kernels' shared-expert pointers (``name``: "gate_up" or "down") and its id; without a shared
    expert, tensors never read."""
    if shared is None:
        return (experts, x_scales, num_experts)
    scales = getattr(shared, name + "_scale")
    return (getattr(shared, name), x_scales if scales is None else scales, num_experts)


def _scale_arguments(x_scales: torch.Tensor, w_scales: torch.Tensor | None) -> tuple:
    """The kernels' scale pointers and strides: activation scales [rows, groups], weight scales
    [E, row blocks, column blocks] (MXFP4's: [E, rows, groups]); without FP8 or MXFP4, any tensor and zero
    strides (never read)."""
    if w_scales is None:
        return (x_scales, x_scales, 0, 0, 0, 0, 0)
    return (x_scales, w_scales, *x_scales.stride(), *w_scales.stride())
