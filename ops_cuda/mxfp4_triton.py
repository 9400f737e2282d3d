"""Reading MXFP4 weights (``ops_cuda/mxfp4.py``: uint8 blocks, two 4-bit e2m1 values a byte, the earlier
column in the low nibble, and a uint8 power-of-two scale per 32 values) inside Triton kernels: as
dequantised tiles for tensor-core products (``mxfp4_step_product``, the fused-MoE kernel) and as rows times a
vector on CUDA cores (``mxfp4_rows_times_vector``, one token's expert kernels), and whole experts
dequantised into a buffer (``dequantise_mxfp4_triton``, for prompts: ``zoo::mxfp4_moe_experts``). Every value times its
scale is exact in float32 and bfloat16, so only the order of the sums differs from a product over the
dequantised weights. All read the blocks as int32 words (eight values each), which halves the integer
work of building each value (``e2m1_pair``); the tiles and the buffer are built alike (``mxfp4_tile``)."""

import torch
import triton
import triton.language as tl

from ops_cuda import mxfp4

GROUP_WORDS = tl.constexpr(mxfp4.GROUP_BYTES // 4)  # the int32 words of a scale's 32 values


@triton.jit
def group_scales(exponents):
    # 2^(s - 127) * 2^14 in float32 for e8m0 exponents s (int32): the scale of values e2m1_pair gives.
    power = tl.where(exponents == 0, 2.0**-127, (exponents << 23).to(tl.float32, bitcast=True))
    return power * 16384.0


@triton.jit
def e2m1_pair(words, position: tl.constexpr):
    # Values `position` and `position + 4` (position 0 to 3) of each uint32 word of eight MXFP4 codes
    # (value i at bits 4i to 4i + 3: the bytes in order, the low nibble first), each 2^-14 times its e2m1
    # value, exactly, in float32: a code's sign, two exponent bits and mantissa bit placed as a
    # float16's sign, lowest two exponent bits and first mantissa bit (float16's exponent bias is 14
    # more than e2m1's; exponent 0 is subnormal in both), the two values built at once as the halves of
    # one word of float16 bits: five integer operations for two values.
    shifted = words >> (4 * position)
    bits = ((shifted & 0x00070007) << 9) | ((shifted & 0x00080008) << 12)
    low = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (bits >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def mxfp4_tile(words, exponents, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # [BLOCK_N, BLOCK_K] in `dtype`: the values of MXFP4 words [BLOCK_N, BLOCK_K / 8] (uint32, eight
    # values each) times their groups' scales (e8m0 exponents [BLOCK_N, BLOCK_K / 32], int32, each
    # spread over its four words), joined back into their columns' order.
    scales = group_scales(exponents)
    scales = tl.reshape(tl.broadcast_to(scales[:, :, None], (BLOCK_N, BLOCK_K // 32, 4)), (BLOCK_N, BLOCK_K // 8))
    v0, v4 = e2m1_pair(words, 0)
    v1, v5 = e2m1_pair(words, 1)
    v2, v6 = e2m1_pair(words, 2)
    v3, v7 = e2m1_pair(words, 3)
    # Each join adds a last axis; joined outermost bit first, value i of a word lands at i.
    pairs_0426 = tl.join(tl.join((v0 * scales).to(dtype), (v4 * scales).to(dtype)),
                         tl.join((v2 * scales).to(dtype), (v6 * scales).to(dtype)))
    pairs_1537 = tl.join(tl.join((v1 * scales).to(dtype), (v5 * scales).to(dtype)),
                         tl.join((v3 * scales).to(dtype), (v7 * scales).to(dtype)))
    return tl.reshape(tl.join(pairs_0426, pairs_1537), (BLOCK_N, BLOCK_K))


@triton.jit
def mxfp4_step_product(x, word_ptrs, scale_ptrs, word_ok, scale_ok, acc, DOT_PRECISION: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    # acc plus rows x [rows, BLOCK_K] times a K-step of MXFP4 weights on tensor cores: the weights' int32
    # words at `word_ptrs` [BLOCK_N, BLOCK_K / 8] (eight values of a row each), their groups' scales at
    # `scale_ptrs` [BLOCK_N, BLOCK_K / 32], each read once; dequantised to x's dtype as one tile
    # (`mxfp4_tile`), one product.
    words = tl.load(word_ptrs, mask=word_ok, other=0).to(tl.uint32, bitcast=True)
    exponents = tl.load(scale_ptrs, mask=scale_ok, other=0).to(tl.int32)
    tile = mxfp4_tile(words, exponents, x.dtype, BLOCK_N, BLOCK_K)
    return tl.dot(x, tl.trans(tile), acc, input_precision=DOT_PRECISION)


@triton.jit
def mxfp4_row_words(word_row_starts, row_ok, start, K, BLOCK_K: tl.constexpr):
    # The int32 words of columns start..start + BLOCK_K of MXFP4 weight rows (`word_row_starts` and
    # `row_ok` [slots, rows, 1]) as uint32, read past the cache: nothing else reuses them.
    words_in_step = tl.arange(0, BLOCK_K // 8)
    word_ok = 8 * words_in_step < K - start
    return tl.load(word_row_starts + start // 8 + words_in_step, mask=row_ok & word_ok, other=0,
                   eviction_policy="evict_first").to(tl.uint32, bitcast=True)


@triton.jit
def mxfp4_rows_times_vector(x_starts, word_row_starts, scale_row_starts, row_ok, K, first_words,
                            BLOCK_K: tl.constexpr):
    # [slots, rows] float32: each MXFP4 weight row (its blocks as int32 words of eight values from
    # `word_row_starts`, its scales from `scale_row_starts`, both [slots, rows, 1], as `row_ok`) times
    # the K values of its slot's vector, at `x_starts` (one pointer, or [slots, 1, 1]), on CUDA cores.
    # `first_words` holds the rows' first step (`mxfp4_row_words` at 0), already read (a caller may
    # read it before waiting on the previous kernel). Each word's values pair up by e2m1_pair, each
    # against its column of x; each group's 32 products are summed unscaled, then times the group's scale.
    words_in_step = tl.arange(0, BLOCK_K // 8)
    groups = tl.arange(0, BLOCK_K // 32)
    SLOTS: tl.constexpr = first_words.shape[0]
    ROWS: tl.constexpr = first_words.shape[1]
    acc = tl.zeros([SLOTS, ROWS, BLOCK_K // 32], dtype=tl.float32)
    words = first_words
    for start in range(0, K, BLOCK_K):
        if start > 0:
            words = mxfp4_row_words(word_row_starts, row_ok, start, K, BLOCK_K)
        word_ok = 8 * words_in_step < K - start
        x_ptrs = x_starts + start + 8 * words_in_step
        products = tl.zeros([SLOTS, ROWS, BLOCK_K // 8], dtype=tl.float32)
        for position in tl.static_range(4):
            low, high = e2m1_pair(words, position)
            x_low = tl.load(x_ptrs + position, mask=word_ok, other=0.0).to(tl.float32)
            x_high = tl.load(x_ptrs + position + 4, mask=word_ok, other=0.0).to(tl.float32)
            products += low * x_low + high * x_high
        group_sums = tl.sum(tl.reshape(products, (SLOTS, ROWS, BLOCK_K // 32, 4)), axis=3)
        group_ok = row_ok & (groups < (K - start) // 32)
        exponents = tl.load(scale_row_starts + start // 32 + groups, mask=group_ok, other=0)
        acc += group_sums * group_scales(exponents.to(tl.int32))
    return tl.sum(acc, axis=2)


@triton.jit
def _dequantise_kernel(words_ptr, scales_ptr, out_ptr, num_rows, row_words, BLOCK_ROWS: tl.constexpr,
                       BLOCK_WORDS: tl.constexpr):
    # Program (r, c): words c*BLOCK_WORDS.. of rows r*BLOCK_ROWS.. of the blocks as int32 words [rows,
    # row_words], their eight values each in order in out [rows, 8 * row_words], one contiguous tile.
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    words = tl.program_id(1) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
    groups = tl.program_id(1) * (BLOCK_WORDS // GROUP_WORDS) + tl.arange(0, BLOCK_WORDS // GROUP_WORDS)
    row_ok = (rows < num_rows)[:, None]
    rows = rows.to(tl.int64)
    packed = tl.load(words_ptr + rows[:, None] * row_words + words[None, :], mask=row_ok & (words < row_words)[None, :],
                     other=0).to(tl.uint32, bitcast=True)
    exponents = tl.load(scales_ptr + rows[:, None] * (row_words // GROUP_WORDS) + groups[None, :],
                        mask=row_ok & (groups < row_words // GROUP_WORDS)[None, :], other=0).to(tl.int32)
    values = mxfp4_tile(packed, exponents, out_ptr.dtype.element_ty, BLOCK_ROWS, 8 * BLOCK_WORDS)
    out_cols = tl.program_id(1) * 8 * BLOCK_WORDS + tl.arange(0, 8 * BLOCK_WORDS)
    tl.store(out_ptr + rows[:, None] * (8 * row_words) + out_cols[None, :], values,
             mask=row_ok & (out_cols < 8 * row_words)[None, :])


def dequantise_mxfp4_triton(blocks, scales, dtype):
    """``ops_cuda.mxfp4.dequantise_mxfp4`` as one kernel: blocks [..., rows, columns / 2] and scales
    [..., rows, columns / 32] -> ``dtype`` [..., rows, columns]."""
    words, scales = blocks.contiguous().view(torch.int32), scales.contiguous()
    row_words = words.shape[-1]
    out = torch.empty(*blocks.shape[:-1], 8 * row_words, dtype=dtype, device=blocks.device)
    num_rows = words.numel() // row_words
    block_rows, block_words = 16, min(64, triton.next_power_of_2(row_words))
    _dequantise_kernel[(triton.cdiv(num_rows, block_rows), triton.cdiv(row_words, block_words))](
        words, scales, out, num_rows, row_words, BLOCK_ROWS=block_rows, BLOCK_WORDS=block_words,
    )
    return out
