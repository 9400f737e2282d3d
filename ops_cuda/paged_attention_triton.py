"""Triton kernels of the paged attention ops (``ops_cuda/paged_attention.py``).

Each kernel has a plain launcher that the op's CUDA registration calls and that the tests call on
CPU tensors under ``TRITON_INTERPRET=1``. This module imports triton, so the op file imports it
only inside its CUDA kernels: ``import ops_cuda`` never needs triton.

Keys and values are read from the paged cache a row at a time through the block table, so any block
size works and a key tile may span several blocks. V's head dim is read through its stride: an FP8 V
cache is key-minor (``ops_cuda.kv_layout.new_kv_cache``), so a V tile's fast axis is its keys, which
the P.V product pairs. Key tiles start at multiples of their size; those wholly inside the sequence
load unmasked and the one holding its end loads whole cache blocks, so every mask stays constant
along a block's keys and a key-minor tile loads in vectors. Over a token-major cache a decode
split's first tile is read before the wait for the kernel before, masked to the keys of earlier
steps, and the step's own key after it (``_decode_split_kernel``).

Scores and the softmax are float32 and use exp2: the scores carry a log2(e) factor, in the scale, or
with soft-capping in the cap (``_score_factors``), and attention sinks where they join the mass, at the
output (``_normalise``; a split decode's in its reduce). An FP8 cache's entries are widened as they load
(exactly; to float16 under a bf16 q, see ``_query_for_cache``), its key scale folded into the score
factor and its value scale into the output. Float32 inputs multiply in full float32
(``input_precision="ieee"``, not TF32) so they match the reference to ~1e-6. Grids and buffers
depend on shapes only, never on data: both ops can be captured in a CUDA graph.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from ops_cuda.dispatch import KERNEL_DTYPES
from ops_cuda.fp8 import FP8_DTYPE
from ops_cuda.kv_layout import check_cache_layout, is_key_minor
from ops_cuda.triton_helpers import begin_after_previous, pdl_launch, tanh

# "No sliding window" is passed as a window longer than any sequence: one code path for both.
NO_WINDOW = 1 << 30
# The running max starts here, not at -inf: a row that has seen no visible key yet then rescales
# by exp2(0) rather than exp2(-inf - -inf) = NaN.
SCORE_FLOOR = tl.constexpr(-1.0e30)
MAX_SPLITS = 64
# Decode programs an SM runs at once, by the program's warps: of four-warp programs (head dim 128)
# three, as their registers allow; of two-warp ones (over an FP8 cache) four, though six fit by
# registers, since the H200's fastest counts follow four. Split counts fill waves of them.
RESIDENT_PROGRAMS = {2: 4, 4: 3}
# More splits are taken for a gain over this share only: the split-count model leaves out sequences
# shorter than the block table and of differing lengths, where each split's start and partial
# output are sure costs.
SPLIT_COST_SLACK = 0.03
LOG2_E = math.log2(math.e)
SINK_LOG2_E = tl.constexpr(LOG2_E)  # a sink's logit into the kernels' base-2 scores


@triton.jit
def _load_kv_tile(cache_ptr, block_tables_ptr, seq, table_stride, kv_head, keys, key_ok, dims, dim_ok,
                  stride_block, stride_slot, stride_head, stride_dim, BLOCK_SIZE: tl.constexpr):
    # [BLOCK_N, BLOCK_D] rows of keys (or values) at positions `keys` of sequence `seq`, found
    # through its block table; rows outside `key_ok` (None: none) are neither read nor looked up (zeros),
    # nor dims outside `dim_ok` (None: none).
    table_row = block_tables_ptr + seq * table_stride
    mask = None if dim_ok is None else dim_ok[None, :]
    if key_ok is None:
        block = tl.load(table_row + keys // BLOCK_SIZE)
    else:
        block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_ok, other=0)
        mask = key_ok[:, None] if dim_ok is None else key_ok[:, None] & dim_ok[None, :]
    rows = block.to(tl.int64) * stride_block + (keys % BLOCK_SIZE) * stride_slot + kv_head * stride_head
    entries = cache_ptr + rows[:, None] + dims[None, :] * stride_dim
    return tl.load(entries) if mask is None else tl.load(entries, mask=mask, other=0.0)


@triton.jit
def _sequence_blocks(keys, seq_len, BLOCK_SIZE: tl.constexpr):
    # Which of `keys` lie in the cache blocks of a sequence of seq_len keys: the last tile's load
    # mask, constant along each block's keys. Its slots past seq_len may hold anything.
    return keys < tl.cdiv(seq_len, BLOCK_SIZE) * BLOCK_SIZE


@triton.jit
def _query_for_cache(q, KV_FP8: tl.constexpr):
    # Over an FP8 cache a bf16 query multiplies in float16: e4m3 entries widen to float16 in one
    # packed conversion per two, where bfloat16 takes three conversions, which then bound the
    # decode kernel below the memory's bandwidth. float16 holds every bf16 value from 2**-14 to
    # 65504 exactly.
    if KV_FP8:
        if q.dtype == tl.bfloat16:
            q = q.to(tl.float16)
    return q


@triton.jit
def _load_v_blocks(v_cache_ptr, block_tables_ptr, seq, table_stride, kv_head, tile, seq_end, dims, dim_ok,
                   v_stride_block, v_stride_head, v_stride_dim, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    # A key-minor V cache's entries for the key tile starting at `tile` (a multiple of BLOCK_N, which
    # BLOCK_SIZE divides), read as the tile's whole cache blocks: [blocks, dims, block_size], each
    # block's keys side by side, 16-byte vector loads. Blocks past `seq_end` (None: the tile lies
    # inside the sequence) are not read: zeros. The last block's slots past it are read as they
    # are, anything, even NaN: the caller zeroes them once it has widened them. Dims outside
    # `dim_ok` (None: none) are zeros.
    blocks_per_tile: tl.constexpr = BLOCK_N // BLOCK_SIZE
    tile_blocks = tile // BLOCK_SIZE + tl.arange(0, blocks_per_tile)
    slots = tl.arange(0, BLOCK_SIZE)
    mask = None if dim_ok is None else dim_ok[None, :, None]
    if seq_end is None:
        block = tl.load(block_tables_ptr + seq * table_stride + tile_blocks)
    else:  # the sequence's blocks only, each whole (a mask constant along a block's keys keeps vector loads)
        in_sequence = tile_blocks * BLOCK_SIZE < seq_end
        block = tl.load(block_tables_ptr + seq * table_stride + tile_blocks, mask=in_sequence, other=0)
        in_sequence = in_sequence[:, None, None]
        mask = in_sequence if dim_ok is None else in_sequence & dim_ok[None, :, None]
    starts = block.to(tl.int64) * v_stride_block + kv_head * v_stride_head
    entries = v_cache_ptr + starts[:, None, None] + dims[None, :, None] * v_stride_dim + slots[None, None, :]
    return tl.load(entries) if mask is None else tl.load(entries, mask=mask, other=0.0)


@triton.jit
def _softmax_step(q, k, running_max, total, visible, score_scale, cap_log2, SOFTCAP: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    # The online softmax over one key tile k [keys, dims], `visible` [rows or 1, keys] of it (None:
    # all): the new running max, the factor rescaling what came before, the tile's unnormalised
    # probabilities and the new softmax mass.
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * score_scale
    if SOFTCAP:
        scores = cap_log2 * tanh(scores)
    if visible is not None:
        scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    rescale = tl.exp2(running_max - new_max)
    p = tl.exp2(scores - new_max[:, None])
    return new_max, rescale, p, total * rescale + tl.sum(p, 1)


@triton.jit
def _normalise(acc, running_max, total, sinks_ptr, heads, head_ok, HAS_SINKS: tl.constexpr):
    # The output acc / total of rows whose scores peaked at running_max; with sinks, each head's sink
    # logit (natural log, read at `heads`) joins the mass as a key of value zero. A row with no
    # visible key gives zeros either way.
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0).to(tl.float32) * SINK_LOG2_E
        top = tl.maximum(running_max, sink)
        kept = tl.exp2(running_max - top)
        return acc * kept[:, None] / (total * kept + tl.exp2(sink - top))[:, None]
    return acc / tl.where(total > 0, total, 1.0)[:, None]


@triton.jit
def _attend_key_tile(q, running_max, total, acc, visible, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq,
                     table_stride, kv_head, tile, seq_end, dims, dim_ok, score_scale, cap_log2,
                     k_stride_block, k_stride_slot, k_stride_head, v_stride_block, v_stride_slot, v_stride_head,
                     v_stride_dim, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, V_BLOCKS: tl.constexpr):
    # One online-softmax step: the rows of q over the key tile starting at `tile`, `visible`
    # [rows or 1, keys] of them (None: all of them, to every row). `seq_end` (None: the tile lies
    # inside the sequence) is the sequence's length: keys past its last cache block are not read,
    # and values at or past it are zeroed, since their slots may hold anything, even NaN, which a
    # zero weight would not cancel. With V_BLOCKS (a key-minor V) V is read as whole cache blocks
    # (`_load_v_blocks`). Returns the updated running max, softmax mass and unnormalised output (its
    # values unscaled).
    keys = tile + tl.arange(0, BLOCK_N)
    key_ok = None if seq_end is None else _sequence_blocks(keys, seq_end, BLOCK_SIZE)
    k = _load_kv_tile(k_cache_ptr, block_tables_ptr, seq, table_stride, kv_head, keys, key_ok, dims, dim_ok,
                      k_stride_block, k_stride_slot, k_stride_head, 1, BLOCK_SIZE)
    if KV_FP8:
        k = k.to(q.dtype)
    new_max, rescale, p, total = _softmax_step(q, k, running_max, total, visible, score_scale, cap_log2, SOFTCAP,
                                               DOT_PRECISION)
    if V_BLOCKS:
        v_blocks = _load_v_blocks(v_cache_ptr, block_tables_ptr, seq, table_stride, kv_head, tile, seq_end, dims,
                                  dim_ok, v_stride_block, v_stride_head, v_stride_dim, BLOCK_SIZE, BLOCK_N)
        v = tl.reshape(tl.permute(v_blocks, (0, 2, 1)), (BLOCK_N, v_blocks.shape[1]))
    else:
        v = _load_kv_tile(v_cache_ptr, block_tables_ptr, seq, table_stride, kv_head, keys, key_ok, dims, dim_ok,
                          v_stride_block, v_stride_slot, v_stride_head, v_stride_dim, BLOCK_SIZE)
    if KV_FP8:
        v = v.to(q.dtype)
    if seq_end is not None:  # after the widening, where the select is on q's dtype, not e4m3's bytes
        v = tl.where((keys < seq_end)[:, None], v, 0.0)
    acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return new_max, total, acc


@triton.jit
def _attend_key_tile_keys_as_rows(q_t, running_max, total, acc, visible, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                                  seq, table_stride, kv_head, tile, seq_end, dims, dim_ok, score_scale,
                                  cap_log2, k_stride_block, k_stride_slot, k_stride_head, v_stride_block,
                                  v_stride_head, v_stride_dim, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr):
    # `_attend_key_tile` over an e4m3 cache with the keys as the rows of both products and the query
    # heads as their columns (8 fill a tensor-core product, where heads as rows are padded to 16).
    # q_t [dims, heads] is float16, and the e4m3 entries widen to it (`_query_for_cache`).
    # The tile's keys start at `tile`; visible [keys, 1], acc [dims, heads]. V is key-minor
    # (`new_kv_cache`) and read as the tile's whole cache blocks (`_load_v_blocks`). `seq_end` as in
    # `_attend_key_tile`.
    keys = tile + tl.arange(0, BLOCK_N)
    key_ok = None if seq_end is None else _sequence_blocks(keys, seq_end, BLOCK_SIZE)
    k = _load_kv_tile(k_cache_ptr, block_tables_ptr, seq, table_stride, kv_head, keys, key_ok, dims, dim_ok,
                      k_stride_block, k_stride_slot, k_stride_head, 1, BLOCK_SIZE)
    scores = tl.dot(k.to(tl.float16), q_t) * score_scale
    if SOFTCAP:
        scores = cap_log2 * tanh(scores)
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 0))
    rescale = tl.exp2(running_max - new_max)
    p = tl.exp2(scores - new_max[None, :])
    total = total * rescale + tl.sum(p, 0)
    v_blocks = _load_v_blocks(v_cache_ptr, block_tables_ptr, seq, table_stride, kv_head, tile, seq_end, dims, dim_ok,
                              v_stride_block, v_stride_head, v_stride_dim, BLOCK_SIZE, BLOCK_N)
    v_t = tl.reshape(tl.permute(v_blocks, (1, 0, 2)), (BLOCK_D, BLOCK_N)).to(tl.float16)
    if seq_end is not None:
        v_t = tl.where((keys < seq_end)[None, :], v_t, 0.0)
    acc = acc * rescale[None, :] + tl.dot(v_t, p.to(tl.float16))
    return new_max, total, acc


@triton.jit
def split_chunks(seq_len, first, num_splits, BLOCK_N: tl.constexpr):
    # How a decode kernel splits the keys first..seq_len-1 of a sequence: the key tile holding the
    # first, the keys of each split from there (whole key tiles, following this sequence's own
    # length) and how many splits hold keys. A short sequence leaves the later splits empty; they
    # write nothing, and the reduce reads the splits that hold keys only.
    first_tile = first // BLOCK_N * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(seq_len - first_tile, num_splits), BLOCK_N) * BLOCK_N
    splits_with_keys = tl.cdiv(seq_len - first_tile, tl.maximum(chunk, 1))  # 0 for a sequence with no keys
    return first_tile, chunk, splits_with_keys


# A mixed step's decodes read the step's block tables and lengths from the row after its prefills,
# at any offset, and their count sets the split count. The kernels specialise on neither: the
# pointers' alignment is left out of the specialisation, and the split count is the grid's third
# dimension (the reduce takes it as an argument). The split kernel the decode graphs compile at
# start-up serves every mixed step, which would otherwise wait about a second for each new
# combination. The reduce compiles for each power of two of the splits (its tile); the graphs'
# batch sizes (each at most twice the one before) meet every one a mixed step can ask for.
UNALIGNED_METADATA = ["block_tables_ptr", "seq_lens_ptr"]


@triton.jit(do_not_specialize_on_alignment=UNALIGNED_METADATA)
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, sinks_ptr, part_out_ptr, part_lse_ptr, out_ptr,
    score_scale, cap_log2, window, v_scale,
    q_stride_b, q_stride_h, out_stride_b, out_stride_h, table_stride,
    k_stride_block, k_stride_slot, k_stride_head, v_stride_block, v_stride_slot, v_stride_head, v_stride_dim,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, KEYS_AS_ROWS: tl.constexpr, V_BLOCKS: tl.constexpr,
    HAS_SINKS: tl.constexpr, PDL: tl.constexpr,
):
    # Stage 1. Program (sequence, kv head, split): the GROUP query heads sharing the kv head (padded
    # to BLOCK_H rows so the scores are one tl.dot) over one chunk of the sequence's visible keys.
    # Writes each head's normalised partial output and its log2-sum-exp2; with one split, the
    # output itself (no reduce stage). With KEYS_AS_ROWS (an e4m3 cache) the keys are the products'
    # rows and the heads their columns (`_attend_key_tile_keys_as_rows`).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)  # the step's metadata, written before its first kernel
    first = tl.maximum(seq_len - window, 0)  # the query at seq_len - 1 sees keys first..seq_len-1
    first_tile, chunk, _ = split_chunks(seq_len, first, num_splits, BLOCK_N)
    start = first_tile + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    # A token-major cache's first key tile of the split is read before the wait, but for the step's
    # own key (at seq_len - 1, which the kernel before writes): earlier steps wrote the others. At
    # batch 1 a split holds one tile, so the program waits for q and that one key row alone.
    EARLY_TILE: tl.constexpr = not (KEYS_AS_ROWS or V_BLOCKS)
    if EARLY_TILE:
        early_keys = start + tl.arange(0, BLOCK_N)
        earlier = (early_keys < seq_len - 1) & (early_keys < end)
        early_k = _load_kv_tile(k_cache_ptr, block_tables_ptr, seq, table_stride, kv_head, early_keys, earlier, dims,
                                dim_ok, k_stride_block, k_stride_slot, k_stride_head, 1, BLOCK_SIZE)
        early_v = _load_kv_tile(v_cache_ptr, block_tables_ptr, seq, table_stride, kv_head, early_keys, earlier, dims,
                                dim_ok, v_stride_block, v_stride_slot, v_stride_head, v_stride_dim, BLOCK_SIZE)
    begin_after_previous(PDL)
    if (num_splits > 1) & (start >= end):
        return  # an empty split: the reduce reads only the splits that hold keys

    rows = tl.arange(0, BLOCK_H)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + seq * q_stride_b + heads[:, None] * q_stride_h + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    running_max = tl.full([BLOCK_H], SCORE_FLOOR, tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    last = seq_len // BLOCK_N * BLOCK_N  # the tile holding the sequence's end (unless it ends one)
    if KEYS_AS_ROWS:
        q_t = tl.trans(q.to(tl.float16))
        acc = tl.zeros([BLOCK_D, BLOCK_H], tl.float32)
        # Unmasked loads where the head dim fills BLOCK_D: a mask would cost them their vector width.
        tile_dim_ok = None if HEAD_DIM == BLOCK_D else dim_ok
        # Five stages: the fewest at which Triton 3.6 gives K and V two buffers each here (four give
        # one), so the next tile's K and V load while this one computes.
        for tile in tl.range(start, tl.minimum(end, last), BLOCK_N, num_stages=5):
            keys = tile + tl.arange(0, BLOCK_N)
            running_max, total, acc = _attend_key_tile_keys_as_rows(
                q_t, running_max, total, acc, (keys >= first)[:, None], k_cache_ptr, v_cache_ptr,
                block_tables_ptr, seq, table_stride, kv_head, tile, None, dims, tile_dim_ok, score_scale,
                cap_log2, k_stride_block, k_stride_slot, k_stride_head, v_stride_block, v_stride_head, v_stride_dim,
                BLOCK_SIZE, BLOCK_N, BLOCK_D, SOFTCAP,
            )
        if (start <= last) & (last < end):
            keys = last + tl.arange(0, BLOCK_N)
            visible = (keys >= first) & (keys < end)
            running_max, total, acc = _attend_key_tile_keys_as_rows(
                q_t, running_max, total, acc, visible[:, None], k_cache_ptr, v_cache_ptr, block_tables_ptr, seq,
                table_stride, kv_head, last, seq_len, dims, tile_dim_ok, score_scale, cap_log2, k_stride_block,
                k_stride_slot, k_stride_head, v_stride_block, v_stride_head, v_stride_dim, BLOCK_SIZE, BLOCK_N, BLOCK_D,
                SOFTCAP,
            )
        acc = tl.trans(acc)
    else:
        q = _query_for_cache(q, KV_FP8)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        rest = start
        if EARLY_TILE:
            own = early_keys == seq_len - 1
            own_k = _load_kv_tile(k_cache_ptr, block_tables_ptr, seq, table_stride, kv_head, early_keys, own, dims,
                                  dim_ok, k_stride_block, k_stride_slot, k_stride_head, 1, BLOCK_SIZE)
            own_v = _load_kv_tile(v_cache_ptr, block_tables_ptr, seq, table_stride, kv_head, early_keys, own, dims,
                                  dim_ok, v_stride_block, v_stride_slot, v_stride_head, v_stride_dim, BLOCK_SIZE)
            k = tl.where(own[:, None], own_k.to(q.dtype), early_k.to(q.dtype))
            v = tl.where(own[:, None], own_v.to(q.dtype), early_v.to(q.dtype))
            visible = (early_keys >= first) & (early_keys < end)
            running_max, rescale, p, total = _softmax_step(q, k, running_max, total, visible[None, :], score_scale,
                                                           cap_log2, SOFTCAP, DOT_PRECISION)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            rest = start + BLOCK_N
        for tile in range(rest, tl.minimum(end, last), BLOCK_N):
            keys = tile + tl.arange(0, BLOCK_N)
            running_max, total, acc = _attend_key_tile(
                q, running_max, total, acc, (keys >= first)[None, :], k_cache_ptr, v_cache_ptr, block_tables_ptr,
                seq, table_stride, kv_head, tile, None, dims, dim_ok, score_scale, cap_log2,
                k_stride_block, k_stride_slot, k_stride_head, v_stride_block, v_stride_slot, v_stride_head,
                v_stride_dim, BLOCK_SIZE, BLOCK_N, SOFTCAP, DOT_PRECISION, KV_FP8, V_BLOCKS,
            )
        if (rest <= last) & (last < end):
            keys = last + tl.arange(0, BLOCK_N)
            visible = (keys >= first) & (keys < end)
            running_max, total, acc = _attend_key_tile(
                q, running_max, total, acc, visible[None, :], k_cache_ptr, v_cache_ptr, block_tables_ptr, seq,
                table_stride, kv_head, last, seq_len, dims, dim_ok, score_scale, cap_log2, k_stride_block,
                k_stride_slot, k_stride_head, v_stride_block, v_stride_slot, v_stride_head, v_stride_dim, BLOCK_SIZE,
                BLOCK_N, SOFTCAP, DOT_PRECISION, KV_FP8, V_BLOCKS,
            )

    # A length-0 padding row under one split (no keys) writes zeros. Sinks join the mass of the
    # whole sequence: in the output of one split, in the reduce of several.
    if num_splits == 1:
        out = _normalise(acc, running_max, total, sinks_ptr, heads, row_ok, HAS_SINKS) * v_scale
        tl.store(out_ptr + seq * out_stride_b + heads[:, None] * out_stride_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        out = acc / tl.where(total > 0, total, 1.0)[:, None] * v_scale
        lse = running_max + tl.log2(total)  # a split that gets here holds keys
        parts = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [B, Hq, num_splits]
        tl.store(part_out_ptr + parts[:, None] * HEAD_DIM + dims[None, :], out,
                 mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(part_lse_ptr + parts, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=["seq_lens_ptr"])
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, seq_lens_ptr, sinks_ptr, out_ptr, window, out_stride_b, out_stride_h, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr, PDL: tl.constexpr,
):
    # Stage 2. Program (sequence, query head): the partial outputs of the splits that hold keys
    # (the others wrote nothing) weighted by their share of the softmax mass.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)  # the step's metadata, written before its first kernel
    _, _, splits_with_keys = split_chunks(seq_len, tl.maximum(seq_len - window, 0), num_splits, BLOCK_N)
    begin_after_previous(PDL)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < splits_with_keys
    dim_ok = dims < HEAD_DIM
    parts = (seq * tl.num_programs(1) + head) * num_splits + splits
    # Both loads issued before either is used: one wait on the memory, not two.
    lse = tl.load(part_lse_ptr + parts, mask=split_ok, other=float("-inf"))
    partial = tl.load(part_out_ptr + parts[:, None] * HEAD_DIM + dims[None, :],
                      mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    top = tl.max(lse, 0)
    if HAS_SINKS:  # the head's sink logit joins the mass as one more part with a zero output
        sink = tl.load(sinks_ptr + head).to(tl.float32) * SINK_LOG2_E
        top = tl.maximum(top, sink)
        weight = tl.exp2(lse - top)
        total = tl.sum(weight, 0) + tl.exp2(sink - top)
    else:
        top = tl.where(top == float("-inf"), 0.0, top)  # all splits empty: a length-0 row, output zeros
        weight = tl.exp2(lse - top)
        total = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * partial, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * out_stride_b + head * out_stride_h + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, sinks_ptr, out_ptr,
    score_scale, cap_log2, window, v_scale,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h, table_stride,
    k_stride_block, k_stride_slot, k_stride_head, v_stride_block, v_stride_slot, v_stride_head, v_stride_dim,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, V_BLOCKS: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    # Program (query tile, head, sequence): BLOCK_M new queries of one head, online softmax over
    # the key tiles they can see (cached context and the new tokens alike, all from the cache).
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # later tiles see more keys: start them first
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:  # the grid covers the longest sequence's tiles
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = head // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < q_len
    dim_ok = dims < HEAD_DIM
    positions = seq_len - q_len + rows
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * q_stride_t + head * q_stride_h + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = _query_for_cache(q, KV_FP8)

    # Keys from the window start of the tile's first query (its key tile) to its last query (or the
    # sequence end). Every query of the tile sees the key tiles after its last query's window start
    # up to its first query whole: those skip the visibility mask.
    first = seq_len - q_len + tile * BLOCK_M  # the tile's first query's position
    begin = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
    end = tl.minimum(first + BLOCK_M, seq_len)
    last = seq_len // BLOCK_N * BLOCK_N  # the key tile holding the sequence's end (unless it ends one)
    stop = tl.minimum(end, last)
    whole_from = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(first + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N, begin),
                            stop)
    whole_to = tl.maximum(tl.minimum((first + 1) // BLOCK_N * BLOCK_N, stop), whole_from)
    running_max = tl.full([BLOCK_M], SCORE_FLOOR, tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for key_tile in range(whole_from, whole_to, BLOCK_N):
        running_max, total, acc = _attend_key_tile(
            q, running_max, total, acc, None, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq,
            table_stride, kv_head, key_tile, None, dims, dim_ok, score_scale, cap_log2,
            k_stride_block, k_stride_slot, k_stride_head, v_stride_block, v_stride_slot, v_stride_head, v_stride_dim,
            BLOCK_SIZE, BLOCK_N, SOFTCAP, DOT_PRECISION, KV_FP8, V_BLOCKS,
        )
    # The tiles seen in part, masked: those across the window's start (before whole_from) and
    # across the diagonal (from whole_to on), in one loop that steps over the whole tiles.
    whole = whole_to - whole_from
    for index in range(begin, stop - whole, BLOCK_N):
        key_tile = tl.where(index < whole_from, index, index + whole)
        keys = key_tile + tl.arange(0, BLOCK_N)
        visible = (keys[None, :] <= positions[:, None]) & (keys[None, :] > positions[:, None] - window)
        running_max, total, acc = _attend_key_tile(
            q, running_max, total, acc, visible, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq,
            table_stride, kv_head, key_tile, None, dims, dim_ok, score_scale, cap_log2,
            k_stride_block, k_stride_slot, k_stride_head, v_stride_block, v_stride_slot, v_stride_head, v_stride_dim,
            BLOCK_SIZE, BLOCK_N, SOFTCAP, DOT_PRECISION, KV_FP8, V_BLOCKS,
        )
    if last < end:
        keys = last + tl.arange(0, BLOCK_N)
        visible = ((keys[None, :] < end) & (keys[None, :] <= positions[:, None])
                   & (keys[None, :] > positions[:, None] - window))
        running_max, total, acc = _attend_key_tile(
            q, running_max, total, acc, visible, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq,
            table_stride, kv_head, last, seq_len, dims, dim_ok, score_scale, cap_log2, k_stride_block,
            k_stride_slot, k_stride_head, v_stride_block, v_stride_slot, v_stride_head, v_stride_dim, BLOCK_SIZE,
            BLOCK_N, SOFTCAP, DOT_PRECISION, KV_FP8, V_BLOCKS,
        )

    heads = tl.full([BLOCK_M], 0, tl.int32) + head
    out = _normalise(acc, running_max, total, sinks_ptr, heads, row_ok, HAS_SINKS) * v_scale
    tl.store(out_ptr + tokens[:, None] * out_stride_t + head * out_stride_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@functools.cache
def shared_memory_per_program(device: torch.device) -> int:
    """The shared memory one program may take on ``device``, in bytes."""
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def decode_num_splits(programs: int, max_len: int, device: torch.device, *, key_bytes: int, partial_bytes: int,
                      block_n: int, resident: int) -> int:
    """How many chunks the decode kernel splits each sequence's keys into, from shapes only (so a
    captured graph keeps it). ``programs`` (sequence, head group) programs each stream ``key_bytes``
    a key of a sequence up to ``max_len`` (the launchers count a key at the query's dtype over an
    FP8 cache too: dequantising it, a kernel spends about a 16-bit key's time on it). Split s ways,
    its keys make chunks of whole key tiles (``block_n`` keys), and programs x chunks run in waves
    of ``resident`` programs an SM: a part-empty last wave takes a whole wave's time. Each program
    costs its chunk and one key tile more (its start: the query's load, the first tile's latency),
    and writes ``partial_bytes`` that the reduce reads back. The fewest splits within
    SPLIT_COST_SLACK of the cheapest count win (``benchmarks/bench_decode_splits.py``: on the H200
    the fastest count in 39 of 51 cases, within 10.3% of it in all)."""
    return _cheapest_splits(programs, max_len, resident * _num_sms(device), key_bytes, partial_bytes, block_n)


# Kept per shape: eager decode attention asks for every layer of every step (a pass over the
# counts takes ~0.5 ms of host time), a captured graph once.
@functools.lru_cache(maxsize=4096)
def _cheapest_splits(programs: int, max_len: int, slots: int, key_bytes: int, partial_bytes: int, block_n: int) -> int:
    def cost(splits: int) -> int:
        chunk = triton.cdiv(triton.cdiv(max_len, splits), block_n) * block_n
        chunks = triton.cdiv(max_len, chunk)
        waves = triton.cdiv(programs * chunks, slots)
        partials = 2 * programs * chunks * partial_bytes if chunks > 1 else 0
        return waves * slots * (chunk + block_n) * key_bytes + partials

    costs = {splits: cost(splits) for splits in range(1, min(triton.cdiv(max_len, block_n), MAX_SPLITS) + 1)}
    cheapest = min(costs.values())
    return min(splits for splits, c in costs.items() if c <= cheapest * (1 + SPLIT_COST_SLACK))


def _score_factors(scale: float, softcap: float) -> tuple[float, float]:
    """(score_scale, cap_log2) of the kernels, whose softmax runs in base 2: the scores are
    q.k * scale * log2(e), or soft-capped, tanh(q.k * scale / softcap) * softcap * log2(e)."""
    if softcap:
        return scale / softcap, softcap * LOG2_E
    return scale * LOG2_E, 1.0


def _check(op: str, q, k_cache, v_cache, out, block_tables):
    dtypes = {q.dtype, out.dtype}
    if len(dtypes) != 1 or not dtypes <= set(KERNEL_DTYPES):
        raise TypeError(f"the CUDA kernel of zoo::{op} takes one of {KERNEL_DTYPES} for q and the output, "
                        f"got {sorted(map(str, dtypes))}")
    cache_dtypes = {k_cache.dtype, v_cache.dtype}
    if len(cache_dtypes) != 1 or not cache_dtypes <= {q.dtype, FP8_DTYPE}:
        raise TypeError(f"the CUDA kernel of zoo::{op} takes caches of q's dtype ({q.dtype}) or {FP8_DTYPE}, "
                        f"got {sorted(map(str, cache_dtypes))}")
    # Kernels index the head dim (and a table row) with stride 1, everything else through strides;
    # V's head dim through its stride too, where the cache is key-minor.
    for name, t in (("q", q), ("out", out), ("block_tables", block_tables)):
        if t.stride(-1) != 1:
            raise ValueError(f"zoo::{op}: {name} must be contiguous in its last dim, got strides {t.stride()}")
    check_cache_layout(op, k_cache, v_cache)


def _check_sinks(op: str, sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    if sinks is not None and (sinks.shape != q.shape[1:2] or sinks.stride(0) != 1 or not sinks.is_floating_point()):
        raise ValueError(f"zoo::{op}: sinks must be one contiguous floating-point logit per query head, shape "
                         f"({q.shape[1]},), got shape {tuple(sinks.shape)}, dtype {sinks.dtype}, strides {sinks.stride()}")


def _sinks_pointer(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    # Without sinks the kernels compile without their loads (HAS_SINKS): any tensor stands for the pointer.
    return q if sinks is None else sinks


def _dot_precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"  # the default; only float32 inputs read it


# Tile shapes. The interpreter (CPU tensors) gets small tiles so the tests' short sequences still
# cross tile boundaries. On the GPU, half types multiply on tensor cores: decode's key tiles of at
# most 16 KiB (as many rows over an FP8 cache, half the bytes) are copied through shared memory
# (prefill's are as large as fits, `_prefill_tiles`). With the keys as rows over an FP8 cache,
# what moves the decode kernel is how many programs share an SM and how much each keeps in
# flight: its whole-tile loop loads the next 64-key tile while one computes, and where the tiles
# are at most 128 dims x 8 heads a program is two warps (160-164 registers a thread, nothing
# spilled), six programs an SM: 1-5% faster alone than five programs of four warps capped at 96
# registers, 5% more tokens a second in a throughput run at the power cap (docs/performance.md).
# Larger tiles (head dims past 128, or 16 query heads a KV head) take four warps, which hold them
# without spilling (Triton 3.6 for sm_90: 125-198 registers). Float32 ("ieee") dots run on FMA
# units with their operands in registers: smaller tiles, chosen so no head size up to 256 spills.


def _head_block(head_dim: int) -> int:
    """The head-dim block: a power of two, and at least the 16 that tl.dot takes along each
    dimension on a GPU; the dims past ``head_dim`` are masked to zeros."""
    return max(16, triton.next_power_of_2(head_dim))


def _decode_tiles(q: torch.Tensor) -> tuple[int, int]:
    """(key tile rows, head-dim block) of the decode kernel: as many rows over an FP8 cache as over
    a 16-bit one, half the bytes (see the tile-shape notes above)."""
    block_d = _head_block(q.shape[-1])
    if not q.is_cuda or q.dtype == torch.float32:
        return 16, block_d
    return max(16, min(64, 16384 // (block_d * q.element_size()))), block_d


def _keys_as_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the decode kernel puts the keys on its products' rows (`_attend_key_tile_keys_as_rows`):
    on CUDA under a 16-bit q, over an FP8 cache whose V is key-minor, in blocks of 16 to 128 keys (a
    power of two) that lie whole in a key tile (`_v_blocks`)."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == FP8_DTYPE
            and k_cache.shape[1] in (16, 32, 64, 128) and _v_blocks(v_cache, _decode_tiles(q)[0]))


def _v_blocks(v_cache: torch.Tensor, block_n: int) -> bool:
    """Whether a kernel with key tiles of ``block_n`` rows reads V as whole cache blocks
    (`_load_v_blocks`): a key-minor V (an FP8 cache's) whose blocks lie whole in a key tile. Read
    through its strides instead, each value would be gathered a byte at a time."""
    return is_key_minor(v_cache) and block_n % v_cache.shape[1] == 0


def _prefill_tiles(q: torch.Tensor) -> tuple[int, int, int, int]:
    """(query tile rows, key tile rows, head-dim block, warps) of the prefill kernel."""
    block_d = _head_block(q.shape[-1])
    if not q.is_cuda:
        return 16, 16, block_d, 4
    if q.dtype == torch.float32:
        return 32, (32 if block_d <= 128 else 16), block_d, 8
    row_bytes = block_d * q.element_size()
    if row_bytes <= 256:  # up to D=128: 128-query tiles fit beside the key tiles
        # 128-key tiles where their K and V stages, the query tile and 16 KiB of scratch fit in a
        # program's shared memory (176 of the H200's 227 KiB at D=128): 1.1-1.15x 64-key tiles
        # there on prompts of 1,024 and 4,096 tokens, with or without cached context.
        wide = (128 + 4 * 128) * row_bytes + (16 << 10) <= shared_memory_per_program(q.device)
        return 128, (128 if wide else 64), block_d, 8
    return 64, max(16, 16384 // row_bytes), block_d, 4


def paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, out,
                                  softcap: float = 0.0, num_splits: int | None = None, k_scale: float = 1.0,
                                  v_scale: float = 1.0, sinks: torch.Tensor | None = None) -> int:
    """Writes zoo::paged_decode_attention(q, ...) into ``out`` [B, Hq, D] and returns the split count
    it ran; ``num_splits`` defaults to ``decode_num_splits``'s pick."""
    _check("paged_decode_attention", q, k_cache, v_cache, out, block_tables)
    _check_sinks("paged_decode_attention", sinks, q)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_n, block_d = _decode_tiles(q)
    keys_as_rows = _keys_as_rows(q, k_cache, v_cache)
    # The query heads fill the products' rows (16 at least) or their columns (8).
    block_h = max(8 if keys_as_rows else 16, triton.next_power_of_2(group))
    # Two warps a program where the tiles fit them (the tile-shape notes above).
    num_warps = 2 if keys_as_rows and block_d <= 128 and block_h <= 8 else 4
    if num_splits is None:
        num_splits = decode_num_splits(
            batch * num_kv_heads, block_tables.shape[1] * block_size, q.device,
            key_bytes=2 * head_dim * q.element_size(), partial_bytes=group * (head_dim + 1) * 4,
            block_n=block_n, resident=RESIDENT_PROGRAMS[num_warps])
    launch = pdl_launch(q)
    # One split (a batch that fills the GPU by itself) writes the output directly.
    part_shape = (batch, num_heads, num_splits) if num_splits > 1 else (0, 0, 0)
    part_out = torch.empty(*part_shape, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, _sinks_pointer(sinks, q), part_out, part_lse, out,
        *_score_factors(scale * k_scale, softcap), sliding_window or NO_WINDOW, float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *k_cache.stride()[:3], *v_cache.stride(),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=block_n, SOFTCAP=bool(softcap),
        DOT_PRECISION=_dot_precision(q), KV_FP8=k_cache.dtype == FP8_DTYPE, KEYS_AS_ROWS=keys_as_rows,
        V_BLOCKS=_v_blocks(v_cache, block_n), HAS_SINKS=sinks is not None,
        num_warps=num_warps, num_stages=3, **launch,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out, part_lse, seq_lens, _sinks_pointer(sinks, q), out, sliding_window or NO_WINDOW, out.stride(0),
            out.stride(1), num_splits, HEAD_DIM=head_dim, BLOCK_N=block_n, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d, HAS_SINKS=sinks is not None, num_warps=4, **launch,
        )
    return num_splits


def paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                                   scale, sliding_window, out, softcap: float = 0.0, k_scale: float = 1.0,
                                   v_scale: float = 1.0, sinks: torch.Tensor | None = None) -> None:
    """Writes zoo::paged_prefill_attention(q, ...) into ``out`` [N, Hq, D], reading every key and
    value (the new tokens' too) from the cache."""
    _check("paged_prefill_attention", q, k_cache, v_cache, out, block_tables)
    _check_sinks("paged_prefill_attention", sinks, q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    block_m, block_n, block_d, num_warps = _prefill_tiles(q)
    grid = (triton.cdiv(max_query_len, block_m), num_heads, seq_lens.shape[0])
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, _sinks_pointer(sinks, q), out,
        *_score_factors(scale * k_scale, softcap), sliding_window or NO_WINDOW, float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *k_cache.stride()[:3], *v_cache.stride(),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, SOFTCAP=bool(softcap), DOT_PRECISION=_dot_precision(q),
        KV_FP8=k_cache.dtype == FP8_DTYPE, V_BLOCKS=_v_blocks(v_cache, block_n), HAS_SINKS=sinks is not None,
        num_warps=num_warps, num_stages=2,
    )
