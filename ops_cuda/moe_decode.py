"""The decode kernel of ``zoo::moe_experts``: a few tokens (a decode step; the op's dispatch sends up to
``ops_cuda.moe.DECODE_MAX_PAIRS`` (token, slot) pairs), each picked expert's weights streamed once, with
no sort and no layout pass.

    gate_up: program (p, n) for pair p whose expert e = ids[p] no earlier pair has picked (the expert's
             "leader"; the others return at once): columns n*BLOCK_N.. of act(gate_e x) * up_e x (or
             the other gated form; each product plus its expert's bias where there are biases) for every
             token that picked e, the tokens as the rows of one tile, so e's rows are read once whatever
             the number of tokens that share it                                        h [P, I]
    down:    program (p, n), the same leaders: columns n*BLOCK_N.. of down_e h for those tokens      y [P, H]
    combine: out[t] = sum over k, in order, of w[t, k] * y[t, k], float32

A token's rows sit at the pair of its first slot that holds e (a token that lists an expert twice gets
it twice in the combine, as in the reference). Ids below zero (an expert on another rank, under expert
parallelism) are skipped: no program leads them and the combine adds nothing for them.

One token (batch-1 decode) takes two other launches, the products on CUDA cores as ``zoo::gemv``
computes them (a tensor-core tile would hold one real row of 16):

    gate_up: program (k, n): columns n*BLOCK_N.. of act(gate_e x) * up_e x for e = ids[k], from e's gate
             and up rows interleaved in one tile (zeros for an id below zero)                  h [K, I]
    down:    program n: rows n*BLOCK_N.. of sum over k, in order, of w[k] * down_{ids[k]} h[k], each
             expert's output rounded to the activation dtype first, as the combine reads it

MXFP4 experts (``zoo::mxfp4_moe_experts``: uint8 blocks and scales, ``ops_cuda/mxfp4.py``) take the same
two launches for one token (``moe_experts_mxfp4_token``), each weight row dequantised in registers as it
streams (``mxfp4_triton.mxfp4_rows_times_vector``); the down kernel, as the bf16 one, reads every expert's
rows a step at a time as one tile, the first before its wait.

Every grid depends on the number of pairs only, and nothing is read back to the host: the op runs under
CUDA-graph capture as it runs eagerly. Numerics are the fused-MoE kernel's (``moe_triton.py``): float32
accumulation, a bias added to it, rounded to the activation dtype where ``F.linear`` and the activation
round. Without biases (HAS_BIAS false) the kernels read none.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ops_cuda.dispatch import KERNEL_DTYPES
from ops_cuda.mxfp4_triton import mxfp4_row_words, mxfp4_rows_times_vector
from ops_cuda.triton_helpers import (
    KERNEL_ACTIVATIONS,
    begin_after_previous,
    begin_after_previous_holding_next,
    bias_or,
    expert_bias,
    gate_up_tile_products,
    gated_rows_times_vector,
    gated_weight_rows,
    interleaved_gated_activation,
    norm_squares,
    pdl_launch,
    round_to,
    store_gated_activation,
    store_into_norm,
    tile_products,
    weight_tile,
    weighted_slot_sum,
)

class DecodeTiles(NamedTuple):
    gate_up_n: int  # columns of h per program (it reads twice as many weight rows: gate and up)
    down_n: int  # columns of y per program
    block_k: int  # reduction step
    num_warps: int
    num_stages: int


# A tile of tl.dot's rows holds every token of the call: more tokens go to the fused-MoE kernel.
DECODE_MAX_TOKENS = 64
# Narrow column tiles so that one token's 8 experts still make several programs per SM (Qwen3-30B-A3B:
# I=768 gives 48 gate_up programs per expert, H=2048 gives 64 down programs), each streaming its rows
# through a 4-stage pipeline.
GPU_TILES = DecodeTiles(gate_up_n=16, down_n=32, block_k=128, num_warps=4, num_stages=4)
# The interpreter (CPU tensors, tests only): the smallest tiles, so tiny shapes span several of them.
INTERPRETER_TILES = DecodeTiles(gate_up_n=16, down_n=16, block_k=16, num_warps=4, num_stages=1)


class TokenTiles(NamedTuple):
    gate_up_n: int  # columns of h per program (twice as many weight rows: gate and up)
    down_n: int  # rows of the output per program
    gate_up_k: int  # columns of a gate_up weight tile
    down_k: int  # columns of a down weight tile: the first is read before h is ready
    num_warps: int


def gpu_token_tiles(hidden_size: int) -> TokenTiles:
    """One token's tiles on the GPU: the fastest that `bench_moe.py --task token-tiles` times on the H200.
    A gate_up program reads a row of up to 2,048 values as one tile (Qwen3-30B-A3B's experts) and
    longer rows in 1,024-column tiles (DeepSeek-V3's 7,168). A down program holds a tile of each of
    the token's experts at once: short ones."""
    return TokenTiles(gate_up_n=1, down_n=4, gate_up_k=2048 if hidden_size <= 2048 else 1024, down_k=256,
                      num_warps=4)


INTERPRETER_TOKEN_TILES = TokenTiles(gate_up_n=2, down_n=4, gate_up_k=16, down_k=16, num_warps=4)
# One token's MXFP4 tiles, whole scale groups a step: gate_up rows 1,024 values (512 bytes) a step; a
# down program 8 rows of each of the token's experts, 512 values a step. On gpt-oss-20b's experts (an
# H100, a probe over 2 to 16 rows, 256 to 1,024 values, 4 or 8 warps): 42.9 µs a layer for the pair,
# the next best 45.3; 50.4 with 1,024-value down steps (the down tile's registers).
MXFP4_TOKEN_TILES = TokenTiles(gate_up_n=4, down_n=8, gate_up_k=1024, down_k=512, num_warps=4)
INTERPRETER_MXFP4_TOKEN_TILES = TokenTiles(gate_up_n=8, down_n=16, gate_up_k=32, down_k=32, num_warps=4)


def one_token_supported(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``moe_experts_decode`` runs these inputs (``decode_supported``'s) as one token's two
    launches, the only ones a split norm's row takes: a single token, the experts' rows contiguous."""
    return hidden.shape[0] == 1 and gate_up.stride(-1) == down.stride(-1) == 1


def decode_supported(hidden: torch.Tensor, topk_ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                     activation: str) -> bool:
    """Whether ``moe_experts_decode`` takes these inputs: one dtype for hidden states and experts, a
    known activation, consistent shapes, and 1 to DECODE_MAX_TOKENS tokens."""
    return (
        hidden.dtype == gate_up.dtype == down.dtype
        and hidden.dtype in KERNEL_DTYPES
        and activation in KERNEL_ACTIVATIONS
        and hidden.dim() == 2
        and topk_ids.dim() == 2
        and topk_ids.shape[0] == hidden.shape[0]
        and topk_ids.numel() > 0
        and hidden.shape[0] <= DECODE_MAX_TOKENS
        and gate_up.shape[2] == down.shape[1] == hidden.shape[1]
        and gate_up.shape[1] == 2 * down.shape[2]
        and gate_up.shape[0] == down.shape[0]
    )


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _lead_expert(ids_ptr, num_pairs, TOP_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr):
    # The expert of this program's pair, -1 unless no earlier pair picked it; the rows of its tokens
    # (the pair of each token's first slot holding it) and which tokens picked it.
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    pairs = tl.arange(0, BLOCK_P)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int64)
    earlier = tl.sum(((ids == expert) & (pairs < pair)).to(tl.int32), axis=0)
    expert = tl.where(earlier == 0, expert, -1)
    # [BLOCK_T, TOP_K] view of the pairs, token by token.
    tokens = tl.arange(0, BLOCK_T)
    slots = tl.arange(0, TOP_K)
    grid = tokens[:, None] * TOP_K + slots[None, :]
    token_ids = tl.load(ids_ptr + grid, mask=grid < num_pairs, other=-1).to(tl.int64)
    first_slot = tl.min(tl.where(token_ids == expert, slots[None, :], TOP_K), axis=1)
    picked = first_slot < TOP_K
    return expert, tokens * TOP_K + first_slot, picked


@triton.jit
def _decode_gate_up_kernel(
    hidden_ptr, ids_ptr, gate_up_ptr, bias_ptr, h_ptr,
    num_pairs, hidden_size, intermediate,
    hidden_stride, w_stride_e, w_stride_n, w_stride_k, h_stride,
    TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    begin_after_previous(PDL)  # the ids choose the weights: nothing can be read before
    expert, rows, picked = _lead_expert(ids_ptr, num_pairs, TOP_K, BLOCK_P, BLOCK_T)
    if expert < 0:
        return
    tokens = tl.arange(0, BLOCK_T).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < intermediate
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = hidden_ptr + tokens[:, None] * hidden_stride + ks[None, :]
    # [BLOCK_K, BLOCK_N] tiles of the expert's gate rows and of its up rows (I rows further), transposed.
    gate_ptrs = gate_up_ptr + expert * w_stride_e + cols[None, :] * w_stride_n + ks[:, None] * w_stride_k
    up_ptrs = gate_ptrs + intermediate * w_stride_n
    gate = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    gate, up = gate_up_tile_products(x_ptrs, gate_ptrs, up_ptrs, picked, col_ok, hidden_size, w_stride_k, gate, up,
                                     DOT_PRECISION, BLOCK_K)
    store_gated_activation(h_ptr + rows[:, None] * h_stride + cols[None, :], picked[:, None] & col_ok[None, :],
                           gate, up, bias_ptr, expert, cols, col_ok, intermediate, HAS_BIAS, ACTIVATION)


@triton.jit
def _decode_down_kernel(
    h_ptr, ids_ptr, down_ptr, bias_ptr, y_ptr,
    num_pairs, hidden_size, intermediate,
    h_stride, w_stride_e, w_stride_n, w_stride_k, y_stride,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    begin_after_previous(PDL)  # the ids choose the weights: nothing can be read before
    expert, rows, picked = _lead_expert(ids_ptr, num_pairs, TOP_K, BLOCK_P, BLOCK_T)
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden_size
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * h_stride + ks[None, :]
    w_ptrs = down_ptr + expert * w_stride_e + cols[None, :] * w_stride_n + ks[:, None] * w_stride_k
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    acc = tile_products(h_ptrs, w_ptrs, picked, col_ok, intermediate, w_stride_k, acc, DOT_PRECISION, BLOCK_K)
    if HAS_BIAS:
        acc += expert_bias(bias_ptr, expert, cols, col_ok, hidden_size)[None, :]
    out = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], out, mask=picked[:, None] & col_ok[None, :])


@triton.jit
def _decode_combine_kernel(
    y_ptr, ids_ptr, weights_ptr, out_ptr, hidden_size, y_stride, weights_stride, out_stride,
    TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    begin_after_previous(PDL)
    # Program (t, c): out[t] = sum over k, in order, of w[t, k] * y at the token's first slot of ids[t, k].
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden_size
    slots = tl.arange(0, TOP_K)
    token_ids = tl.load(ids_ptr + token * TOP_K + slots)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + token * TOP_K + k)
        first_slot = tl.min(tl.where(token_ids == expert, slots, TOP_K), axis=0)
        weight = tl.load(weights_ptr + token * weights_stride + k).to(tl.float32)
        row = token * TOP_K + first_slot
        present = cols < tl.where(expert >= 0, hidden_size, 0)  # a missing expert's row was never written
        y = tl.load(y_ptr + row * y_stride + cols, mask=present, other=0.0).to(tl.float32)
        acc += y * weight
    tl.store(out_ptr + token * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _token_gate_up_kernel(
    hidden_ptr, ids_ptr, gate_up_ptr, bias_ptr, h_ptr, stats_ptr, hidden_size, intermediate, w_stride_e, w_stride_n,
    eps, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, NORMED: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    # The ids choose the weights: nothing can be read before the wait. The down kernel reads them
    # before its own wait, so it starts only once the router has written them. NORMED: the hidden row
    # is a split norm's weighted row (ops_cuda.gemv), whose 1 / rms scales the products.
    begin_after_previous_holding_next(PDL)
    # One token, program (k, n): columns n*BLOCK_N.. of h for its k-th expert, from that expert's gate
    # and up rows interleaved as one [2 * BLOCK_N, BLOCK_K] tile.
    # An id below zero (another rank's expert) reads nothing and writes zeros (every gated form of zero
    # gate and up is zero), which the down kernel reads.
    slot = tl.program_id(0)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    weight_rows, cols = gated_weight_rows(tl.program_id(1) * BLOCK_N, intermediate, BLOCK_N)
    row_ok = cols < tl.where(expert >= 0, intermediate, 0)
    row_starts = gate_up_ptr + tl.maximum(expert, 0) * w_stride_e + weight_rows[:, None].to(tl.int64) * w_stride_n
    first_tile = weight_tile(row_starts, row_ok[:, None], tl.arange(0, BLOCK_K), hidden_size)
    squares = norm_squares(stats_ptr) if NORMED else 0.0  # beside the first tile, not before the ids
    if HAS_BIAS:
        bias = expert_bias(bias_ptr, tl.maximum(expert, 0), weight_rows, row_ok, 2 * intermediate)
    else:
        bias = 0.0
    dtype = h_ptr.dtype.element_ty
    h = gated_rows_times_vector(hidden_ptr, row_starts, row_ok[:, None], hidden_size, first_tile, bias, squares,
                                eps, dtype, ACTIVATION, NORMED, BLOCK_N, BLOCK_K)
    h_cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(h_ptr + slot * intermediate + h_cols, h.to(dtype), mask=h_cols < intermediate)


@triton.jit
def _token_down_combine_kernel(
    h_ptr, ids_ptr, weights_ptr, down_ptr, bias_ptr, out_ptr, residual_ptr, norm_weight_ptr, weighted_ptr, stats_ptr,
    hidden_size, intermediate, top_k, w_stride_e, w_stride_n, HAS_BIAS: tl.constexpr, INTO_NORM: tl.constexpr,
    BLOCK_SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    # One token, program n: rows n*BLOCK_N.. of out = sum over k, in order, of w[k] * down_{ids[k]} h[k]
    # (plus that expert's bias), each expert's output rounded to the activation dtype first, as the
    # reference's combine reads it. The ids are the router's, finished before the gate_up kernel passed
    # its wait and let this one start: they, every expert's first weight tile and its bias are read
    # while gate_up still runs, h only after. INTO_NORM: out is the input of a split RMSNorm
    # (store_into_norm), written as the new residual.
    slots = tl.arange(0, BLOCK_SLOTS)
    slot_ok = slots < top_k
    experts = tl.load(ids_ptr + slots, mask=slot_ok, other=-1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # [slots, rows]: an id below zero (another rank's expert) reads nothing; its h row is zeros.
    present = (experts[:, None] >= 0) & (rows[None, :] < hidden_size)
    row_starts = down_ptr + tl.maximum(experts, 0)[:, None, None] * w_stride_e \
        + rows[None, :, None].to(tl.int64) * w_stride_n
    cols = tl.arange(0, BLOCK_K)
    w = weight_tile(row_starts, present[:, :, None], cols, intermediate)
    if HAS_BIAS:
        bias = expert_bias(bias_ptr, tl.maximum(experts, 0)[:, None], rows[None, :], present, hidden_size)
    if INTO_NORM:
        norm_weight = tl.load(norm_weight_ptr + rows, mask=rows < hidden_size, other=0.0).to(tl.float32)
    begin_after_previous(PDL)
    y = tl.zeros([BLOCK_SLOTS, BLOCK_N], dtype=tl.float32)
    for start in range(0, intermediate, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        if start > 0:
            w = weight_tile(row_starts, present[:, :, None], cols, intermediate)
        h = tl.load(h_ptr + slots[:, None] * intermediate + cols[None, :],
                    mask=slot_ok[:, None] & (cols < intermediate)[None, :], other=0.0)
        y += tl.sum(w.to(tl.float32) * h[:, None, :].to(tl.float32), axis=2)
    if HAS_BIAS:
        y += bias
    dtype = out_ptr.dtype.element_ty
    out = weighted_slot_sum(y, weights_ptr, slots, slot_ok, dtype, BLOCK_SLOTS)
    if INTO_NORM:
        store_into_norm(round_to(out, dtype), rows, rows < hidden_size, residual_ptr, norm_weight, out_ptr,
                        weighted_ptr, stats_ptr)
    else:
        tl.store(out_ptr + rows, out.to(dtype), mask=rows < hidden_size)


@triton.jit
def _mxfp4_token_gate_up_kernel(
    hidden_ptr, ids_ptr, words_ptr, scales_ptr, bias_ptr, h_ptr, hidden_size, intermediate,
    words_stride_e, words_stride_n, scales_stride_e, scales_stride_n,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    begin_after_previous_holding_next(PDL)  # the ids choose the weights; the down kernel reads them early
    # One token, program (k, n): columns n*BLOCK_N.. of h for its k-th expert, from that expert's gate
    # and up rows interleaved (as _token_gate_up_kernel's), each an MXFP4 row (its blocks as int32
    # words), as one slot of [1, 2 * BLOCK_N] rows. An id below zero reads nothing and writes zeros.
    slot = tl.program_id(0)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    weight_rows, cols = gated_weight_rows(tl.program_id(1) * BLOCK_N, intermediate, BLOCK_N)
    row_ok = cols < tl.where(expert >= 0, intermediate, 0)
    held = tl.maximum(expert, 0)
    rows = weight_rows.to(tl.int64)[None, :, None]
    word_row_starts = words_ptr + held * words_stride_e + rows * words_stride_n
    first_words = mxfp4_row_words(word_row_starts, row_ok[None, :, None], 0, hidden_size, BLOCK_K)
    products = mxfp4_rows_times_vector(hidden_ptr, word_row_starts,
                                       scales_ptr + held * scales_stride_e + rows * scales_stride_n,
                                       row_ok[None, :, None], hidden_size, first_words, BLOCK_K)
    products = tl.reshape(products, [2 * BLOCK_N])
    if HAS_BIAS:
        products += expert_bias(bias_ptr, held, weight_rows, row_ok, 2 * intermediate)
    dtype = h_ptr.dtype.element_ty
    h = interleaved_gated_activation(products, dtype, ACTIVATION, BLOCK_N)
    h_cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(h_ptr + slot * intermediate + h_cols, h.to(dtype), mask=h_cols < intermediate)


@triton.jit
def _mxfp4_token_down_combine_kernel(
    h_ptr, ids_ptr, weights_ptr, words_ptr, scales_ptr, bias_ptr, out_ptr, hidden_size, intermediate, top_k,
    words_stride_e, words_stride_n, scales_stride_e, scales_stride_n,
    HAS_BIAS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    # One token, program n: rows n*BLOCK_N.. of out as _token_down_combine_kernel's, from MXFP4 rows, the
    # token's experts as the slots of one [slots, rows] tile. The ids are the router's, finished before
    # the gate_up kernel passed its wait and let this one start: they, every expert's first words and
    # its bias are read while gate_up still runs, h only after.
    slots = tl.arange(0, BLOCK_SLOTS)
    slot_ok = slots < top_k
    experts = tl.load(ids_ptr + slots, mask=slot_ok, other=-1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    present = (experts[:, None] >= 0) & (rows[None, :] < hidden_size)  # [slots, rows]
    held = tl.maximum(experts, 0)
    word_row_starts = words_ptr + held[:, None, None] * words_stride_e + rows[None, :, None] * words_stride_n
    words = mxfp4_row_words(word_row_starts, present[:, :, None], 0, intermediate, BLOCK_K)
    if HAS_BIAS:
        bias = expert_bias(bias_ptr, held[:, None], rows[None, :], present, hidden_size)
    begin_after_previous(PDL)
    # Slots past top_k read the last slot's h against zero weights.
    h_starts = (h_ptr + tl.minimum(slots, top_k - 1) * intermediate)[:, None, None]
    scale_row_starts = scales_ptr + held[:, None, None] * scales_stride_e + rows[None, :, None] * scales_stride_n
    y = mxfp4_rows_times_vector(h_starts, word_row_starts, scale_row_starts, present[:, :, None], intermediate, words,
                                BLOCK_K)
    if HAS_BIAS:
        y += bias
    dtype = out_ptr.dtype.element_ty
    out = weighted_slot_sum(y, weights_ptr, slots, slot_ok, dtype, BLOCK_SLOTS)
    tl.store(out_ptr + rows, out.to(dtype), mask=rows < hidden_size)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def moe_experts_decode(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    token_tiles: TokenTiles | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """``zoo::moe_experts`` for a few tokens; the caller checks ``decode_supported`` first (and the biases'
    dtype and shape). ``token_tiles``: one token's tiles in place of the device's (`bench_moe.py --task
    token-tiles` sweeps them). ``norm``, one token's only (``ops_cuda.gemv``): a split norm's sums of
    squares and epsilon, ``hidden`` its weighted row."""
    num_tokens, hidden_size = hidden.shape
    intermediate, top_k = down.shape[2], topk_ids.shape[1]
    num_pairs = topk_ids.numel()
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    ids = topk_ids.contiguous()
    if one_token_supported(hidden, gate_up, down):
        h = _token_gate_up(hidden, ids, gate_up, activation, gate_up_bias, token_tiles, norm)
        out = torch.empty_like(hidden)
        _token_down_combine(h, topk_weights, ids, down, down_bias, token_tiles, out)
        return out
    if norm is not None:
        raise ValueError(f"a split norm's row is one token's: hidden has {num_tokens} tokens")
    tiles = GPU_TILES if hidden.is_cuda else INTERPRETER_TILES
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"  # only float32 operands read it
    # TOP_K is a power of two for the [tokens, slots] view: pad each token's slots with -1 where it is not.
    if top_k & (top_k - 1):
        slots = triton.next_power_of_2(top_k)
        ids = torch.nn.functional.pad(ids, (0, slots - top_k), value=-1)
        topk_weights = torch.nn.functional.pad(topk_weights, (0, slots - top_k))
        top_k, num_pairs = slots, ids.numel()
    launch = dict(TOP_K=top_k, DOT_PRECISION=precision, BLOCK_P=triton.next_power_of_2(num_pairs),
                  BLOCK_T=max(16, triton.next_power_of_2(num_tokens)), BLOCK_K=tiles.block_k,
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_launch(hidden))

    h = torch.empty(num_pairs, intermediate, dtype=hidden.dtype, device=hidden.device)
    _decode_gate_up_kernel[(num_pairs, triton.cdiv(intermediate, tiles.gate_up_n))](
        hidden, ids, gate_up, bias_or(gate_up_bias, gate_up), h,
        num_pairs, hidden_size, intermediate,
        hidden.stride(0), *gate_up.stride(), h.stride(0),
        ACTIVATION=KERNEL_ACTIVATIONS[activation], HAS_BIAS=gate_up_bias is not None, BLOCK_N=tiles.gate_up_n,
        **launch,
    )
    y = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _decode_down_kernel[(num_pairs, triton.cdiv(hidden_size, tiles.down_n))](
        h, ids, down, bias_or(down_bias, down), y,
        num_pairs, hidden_size, intermediate,
        h.stride(0), *down.stride(), y.stride(0),
        HAS_BIAS=down_bias is not None, BLOCK_N=tiles.down_n, **launch,
    )
    weights = topk_weights.to(torch.float32).contiguous()
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    block = min(triton.next_power_of_2(hidden_size), 1024)
    _decode_combine_kernel[(num_tokens, triton.cdiv(hidden_size, block))](
        y, ids, weights, out, hidden_size, y.stride(0), weights.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK=block, num_warps=4, **pdl_launch(hidden),
    )
    return out


def moe_experts_token_into_norm(
    weighted: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    norm: tuple[torch.Tensor, float],
    into_norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``zoo::normed_moe_experts_into_norm`` for one token between two split norms (``ops_cuda.gemv``):
    ``norm``, the first's sums of squares and epsilon, ``weighted`` its weighted row; ``into_norm``, the
    residual, weight and slots of the second. Returns (summed, weighted) as ``zoo::gemv_into_norm``;
    the caller checks ``decode_supported`` and ``one_token_supported`` first."""
    weighted, ids = weighted.contiguous(), topk_ids.contiguous()
    h = _token_gate_up(weighted, ids, gate_up, activation, gate_up_bias, None, norm)
    summed, next_weighted = torch.empty_like(weighted), torch.empty_like(weighted)
    residual, norm_weight, next_stats = into_norm
    _token_down_combine(h, topk_weights, ids, down, down_bias, None, summed,
                        (residual, norm_weight, next_weighted, next_stats))
    return summed, next_weighted


def _token_launch(hidden, tiles):
    if tiles is None:
        tiles = gpu_token_tiles(hidden.shape[1]) if hidden.is_cuda else INTERPRETER_TOKEN_TILES
    return tiles, dict(num_warps=tiles.num_warps, **pdl_launch(hidden))


def _token_gate_up(hidden, ids, gate_up, activation, gate_up_bias, tiles, norm):
    # The first of one token's two launches: gate_up with the activation for every slot (and a split
    # norm's 1 / rms).
    hidden_size, intermediate, top_k = hidden.shape[1], gate_up.shape[1] // 2, ids.shape[1]
    tiles, launch = _token_launch(hidden, tiles)
    h = torch.empty(top_k, intermediate, dtype=hidden.dtype, device=hidden.device)
    stats, eps = norm if norm is not None else (hidden, 0.0)
    _token_gate_up_kernel[(top_k, triton.cdiv(intermediate, tiles.gate_up_n))](
        hidden, ids, gate_up, bias_or(gate_up_bias, gate_up), h, stats, hidden_size, intermediate, gate_up.stride(0),
        gate_up.stride(1), float(eps), ACTIVATION=KERNEL_ACTIVATIONS[activation], HAS_BIAS=gate_up_bias is not None,
        NORMED=norm is not None, BLOCK_N=tiles.gate_up_n,
        BLOCK_K=min(tiles.gate_up_k, triton.next_power_of_2(hidden_size)), **launch,
    )
    return h


def _token_down_combine(h, topk_weights, ids, down, down_bias, tiles, out, into_norm=None):
    # The second: down with the weighted sum into out (and, given the residual, weight, weighted row and
    # slots of the split norm after it, that norm's first half).
    hidden_size, intermediate, top_k = out.shape[1], down.shape[2], ids.shape[1]
    tiles, launch = _token_launch(out, tiles)
    residual, norm_weight, weighted, next_stats = into_norm if into_norm is not None else (out,) * 4  # not read
    _token_down_combine_kernel[(triton.cdiv(hidden_size, tiles.down_n),)](
        h, ids, topk_weights.to(torch.float32).contiguous(), down, bias_or(down_bias, down), out, residual,
        norm_weight, weighted, next_stats, hidden_size, intermediate, top_k, down.stride(0), down.stride(1),
        HAS_BIAS=down_bias is not None, INTO_NORM=into_norm is not None, BLOCK_SLOTS=triton.next_power_of_2(top_k),
        BLOCK_N=tiles.down_n, BLOCK_K=min(tiles.down_k, triton.next_power_of_2(intermediate)), **launch,
    )


def moe_experts_mxfp4_token(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_blocks: torch.Tensor,
    gate_up_scales: torch.Tensor,
    down_blocks: torch.Tensor,
    down_scales: torch.Tensor,
    activation: str,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``zoo::mxfp4_moe_experts`` for one token (hidden [1, H]) in two launches; the caller checks the
    blocks against their scales, the activation and the biases, as for ``moe_triton.moe_experts_triton``."""
    hidden_size, intermediate, top_k = hidden.shape[1], 2 * down_blocks.shape[2], topk_ids.shape[1]
    tiles = MXFP4_TOKEN_TILES if hidden.is_cuda else INTERPRETER_MXFP4_TOKEN_TILES
    hidden, ids = hidden.contiguous(), topk_ids.contiguous()
    gate_up_words, down_words = gate_up_blocks.view(torch.int32), down_blocks.view(torch.int32)  # 8 values a word
    launch = dict(num_warps=tiles.num_warps, **pdl_launch(hidden))
    h = torch.empty(top_k, intermediate, dtype=hidden.dtype, device=hidden.device)
    _mxfp4_token_gate_up_kernel[(top_k, triton.cdiv(intermediate, tiles.gate_up_n))](
        hidden, ids, gate_up_words, gate_up_scales, bias_or(gate_up_bias, hidden), h, hidden_size, intermediate,
        gate_up_words.stride(0), gate_up_words.stride(1), gate_up_scales.stride(0), gate_up_scales.stride(1),
        ACTIVATION=KERNEL_ACTIVATIONS[activation], HAS_BIAS=gate_up_bias is not None, BLOCK_N=tiles.gate_up_n,
        BLOCK_K=tiles.gate_up_k, **launch,
    )
    out = torch.empty_like(hidden)
    _mxfp4_token_down_combine_kernel[(triton.cdiv(hidden_size, tiles.down_n),)](
        h, ids, topk_weights.to(torch.float32).contiguous(), down_words, down_scales, bias_or(down_bias, hidden), out,
        hidden_size, intermediate, top_k, down_words.stride(0), down_words.stride(1), down_scales.stride(0),
        down_scales.stride(1), HAS_BIAS=down_bias is not None, BLOCK_SLOTS=triton.next_power_of_2(top_k),
        BLOCK_N=tiles.down_n, BLOCK_K=tiles.down_k, **launch,
    )
    return out
