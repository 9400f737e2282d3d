"""Triton kernels of the latent attention ops (``ops_cuda/mla_attention.py``).

Decode is split-KV flash-decoding over the latent pool. A program takes one sequence, a tile of
``BLOCK_H`` heads and one chunk of its keys: every latent row it loads serves all the heads of its
tile twice, as the key (scores against the absorbed queries, plus the rope part) and as the value,
so with DeepSeek-V3's 128 heads each step reads the latent cache once per head tile, the tiles of a
chunk running side by side over the same rows in L2. A second kernel sums the chunks' partial
outputs by their softmax mass.

Prefill is flash attention over ragged runs of decompressed keys: per-head nope keys and values,
one rope key per token shared by all heads, qk and v head dims independent.

An FP8 pool's entries are widened to the query's dtype as they load (the paged kernels widen them to
float16 under a bf16 query), and as in ``ops_cuda/paged_attention_triton.py`` its scale is folded
into the score factor and the output; the softmax runs in base 2 in float32, float32 inputs
multiply in full float32, and grids and buffers follow shapes only, so decode can be captured in a
CUDA graph. This module imports triton: the op file imports it only inside its CUDA kernels.
"""

import torch
import triton
import triton.language as tl

from ops_cuda.fp8 import FP8_DTYPE
from ops_cuda.paged_attention_triton import (
    LOG2_E, SCORE_FLOOR, UNALIGNED_METADATA, decode_num_splits, shared_memory_per_program, split_chunks,
)
from ops_cuda.triton_helpers import begin_after_previous, check_dtypes, pdl_launch

# Decode programs an SM holds at once: 8 warps of up to 255 registers a thread fill its register file.
RESIDENT_PROGRAMS = 1


@triton.jit(do_not_specialize_on_alignment=UNALIGNED_METADATA)
def _mla_decode_split_kernel(
    q_latent_ptr, q_rope_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr, out_ptr,
    score_scale, kv_scale, num_heads,
    ql_stride_b, ql_stride_h, qr_stride_b, qr_stride_h, out_stride_b, out_stride_h, table_stride,
    cache_stride_block, cache_stride_slot,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_ROPE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr,
):
    # Stage 1. Program (sequence, head tile, split): the tile's heads over one chunk of the keys.
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)  # the step's metadata, written before its first kernel
    begin_after_previous(PDL)
    _, chunk, _ = split_chunks(seq_len, 0, num_splits, BLOCK_N)  # every key is visible
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    if (num_splits > 1) & (start >= end):
        return  # an empty split: the reduce reads only the splits that hold keys

    head_ok = heads < num_heads
    dims = tl.arange(0, BLOCK_R)
    dim_ok = dims < RANK
    rope_dims = tl.arange(0, BLOCK_ROPE)
    rope_ok = rope_dims < ROPE
    q_latent = tl.load(q_latent_ptr + seq * ql_stride_b + heads[:, None] * ql_stride_h + dims[None, :],
                       mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    q_rope = tl.load(q_rope_ptr + seq * qr_stride_b + heads[:, None] * qr_stride_h + rope_dims[None, :],
                     mask=head_ok[:, None] & rope_ok[None, :], other=0.0)

    running_max = tl.full([BLOCK_H], SCORE_FLOOR, tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for tile in range(start, end, BLOCK_N):
        keys = tile + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        block = tl.load(block_tables_ptr + seq * table_stride + keys // BLOCK_SIZE, mask=key_ok, other=0)
        rows = block.to(tl.int64) * cache_stride_block + (keys % BLOCK_SIZE) * cache_stride_slot
        latent = tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        k_rope = tl.load(cache_ptr + rows[:, None] + RANK + rope_dims[None, :],
                         mask=key_ok[:, None] & rope_ok[None, :], other=0.0)
        if KV_FP8:
            latent = latent.to(tl.float32).to(q_latent.dtype)
            k_rope = k_rope.to(tl.float32).to(q_latent.dtype)
        scores = tl.dot(q_latent, tl.trans(latent), input_precision=DOT_PRECISION)
        scores += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
        scores = tl.where(key_ok[None, :], scores * score_scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp2(running_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        total = total * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=DOT_PRECISION)
        running_max = new_max

    # A length-0 padding row under one split (no keys) writes zeros.
    out = acc / tl.where(total > 0, total, 1.0)[:, None] * kv_scale
    if num_splits == 1:
        tl.store(out_ptr + seq * out_stride_b + heads[:, None] * out_stride_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])
    else:
        lse = running_max + tl.log2(total)  # a split that gets here holds keys
        parts = ((seq * num_heads + heads) * num_splits + split).to(tl.int64)  # [B, H, num_splits]
        tl.store(part_out_ptr + parts[:, None] * RANK + dims[None, :], out, mask=head_ok[:, None] & dim_ok[None, :])
        tl.store(part_lse_ptr + parts, lse, mask=head_ok)


@triton.jit(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=["seq_lens_ptr"])
def _mla_decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, seq_lens_ptr, out_ptr, out_stride_b, out_stride_h, num_splits,
    RANK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):
    # Stage 2. Program (sequence, head): the partial outputs of the splits that hold keys (the others
    # wrote nothing) weighted by their share of the softmax mass, summed one split at a time (a
    # whole [splits, rank] tile would not fit in registers).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    _, _, splits_with_keys = split_chunks(tl.load(seq_lens_ptr + seq), 0, num_splits, BLOCK_N)
    begin_after_previous(PDL)
    parts = ((seq * tl.num_programs(1) + head) * num_splits).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    lse = tl.load(part_lse_ptr + parts + splits, mask=splits < splits_with_keys, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # all splits empty: a length-0 row, output zeros
    total = tl.sum(tl.exp2(lse - top), 0)
    dims = tl.arange(0, BLOCK_R)
    dim_ok = dims < RANK
    acc = tl.zeros([BLOCK_R], tl.float32)
    for split in range(splits_with_keys):
        weight = tl.exp2(tl.load(part_lse_ptr + parts + split) - top)
        acc += weight * tl.load(part_out_ptr + (parts + split) * RANK + dims, mask=dim_ok, other=0.0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * out_stride_b + head * out_stride_h + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


@triton.jit
def _mla_prefill_kernel(
    q_nope_ptr, q_rope_ptr, k_nope_ptr, k_rope_ptr, v_ptr, query_start_loc_ptr, key_start_loc_ptr, out_ptr,
    score_scale,
    qn_stride_t, qn_stride_h, qr_stride_t, qr_stride_h, kn_stride_t, kn_stride_h, kr_stride_t,
    v_stride_t, v_stride_h, out_stride_t, out_stride_h,
    NOPE: tl.constexpr, ROPE: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_ROPE: tl.constexpr,
    BLOCK_V: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Program (query tile, head, sequence): BLOCK_M new queries of one head, online softmax over the
    # key tiles they can see.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # later tiles see more keys: start them first
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:  # the grid covers the longest sequence's tiles
        return
    k_start = tl.load(key_start_loc_ptr + seq)
    k_len = tl.load(key_start_loc_ptr + seq + 1) - k_start

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    positions = k_len - q_len + rows
    tokens = (q_start + rows).to(tl.int64)
    nope_dims, rope_dims, v_dims = tl.arange(0, BLOCK_NOPE), tl.arange(0, BLOCK_ROPE), tl.arange(0, BLOCK_V)
    nope_ok, rope_ok, v_ok = nope_dims < NOPE, rope_dims < ROPE, v_dims < V_DIM
    q_nope = tl.load(q_nope_ptr + tokens[:, None] * qn_stride_t + head * qn_stride_h + nope_dims[None, :],
                     mask=row_ok[:, None] & nope_ok[None, :], other=0.0)
    q_rope = tl.load(q_rope_ptr + tokens[:, None] * qr_stride_t + head * qr_stride_h + rope_dims[None, :],
                     mask=row_ok[:, None] & rope_ok[None, :], other=0.0)

    end = tl.minimum(k_len - q_len + (tile + 1) * BLOCK_M, k_len)  # the tile's last query sees keys up to here
    running_max = tl.full([BLOCK_M], SCORE_FLOOR, tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    for key_tile in range(0, end, BLOCK_N):
        keys = key_tile + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        key_rows = (k_start + keys).to(tl.int64)
        k_nope = tl.load(k_nope_ptr + key_rows[:, None] * kn_stride_t + head * kn_stride_h + nope_dims[None, :],
                         mask=key_ok[:, None] & nope_ok[None, :], other=0.0)
        k_rope = tl.load(k_rope_ptr + key_rows[:, None] * kr_stride_t + rope_dims[None, :],
                         mask=key_ok[:, None] & rope_ok[None, :], other=0.0)
        scores = tl.dot(q_nope, tl.trans(k_nope), input_precision=DOT_PRECISION)
        scores += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
        visible = key_ok[None, :] & (keys[None, :] <= positions[:, None])
        scores = tl.where(visible, scores * score_scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp2(running_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        total = total * rescale + tl.sum(p, 1)
        v = tl.load(v_ptr + key_rows[:, None] * v_stride_t + head * v_stride_h + v_dims[None, :],
                    mask=key_ok[:, None] & v_ok[None, :], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        running_max = new_max

    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + tokens[:, None] * out_stride_t + head * out_stride_h + v_dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])


def _block(n: int) -> int:
    # A tile dim: a power of two, at least tl.dot's 16.
    return max(16, triton.next_power_of_2(n))


def _check(op: str, **tensors: torch.Tensor) -> None:
    check_dtypes(op, *(t for t in tensors.values() if t.is_floating_point() and t.dtype != FP8_DTYPE))
    # Kernels index the last dim with stride 1, everything else through strides.
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"zoo::{op}: {name} must be contiguous in its last dim, got strides {t.stride()}")


def _dot_precision(t: torch.Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"  # the default; only float32 inputs read it


def mla_decode_tiles(q_latent: torch.Tensor, cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(heads per program, key tile rows, warps, pipeline stages) of the decode kernel. Each program
    holds its heads' [BLOCK_H, kv_lora_rank] float32 accumulator in registers: for sm_90 (Triton
    3.6, 32-key tiles), 32 heads of rank 512 over 8 warps compile to 180 registers a thread and 64
    heads to 254 (over an e4m3 pool they spill some), yet on the H200 64 run 1.8x faster than 32 at
    batch 64 and 256 (each latent row loaded serves twice the heads) and as fast at batch 1
    (``benchmarks/bench_mla.py --sweep``); 16 warps, which spill nothing, run at half the speed. Key
    tiles of 64 rows run 1.4-1.6x faster than 32 at batch 64 and 256, with three stages over a bf16
    pool and two over an e4m3 one (docs/performance.md). The interpreter (CPU tensors) and float32
    take the smallest tiles."""
    if not q_latent.is_cuda:
        return 16, 16, 4, 2
    if q_latent.dtype == torch.float32:
        return 16, 16, 8, 2
    block_h = min(64, _block(q_latent.shape[1]))
    return block_h, 64, 4 if block_h == 16 else 8, 2 if cache.dtype == FP8_DTYPE else 3


def mla_decode_attention_triton(q_latent, q_rope, cache, block_tables, seq_lens, scale, out,
                                block_h: int | None = None, num_splits: int | None = None,
                                kv_scale: float = 1.0, block_n: int | None = None) -> int:
    """Writes zoo::mla_decode_attention(q_latent, ...) into ``out`` [B, H, kv_lora_rank] (the cache
    of q's dtype or float8_e4m3fn, its entries times ``kv_scale``) and returns the split count it ran;
    ``block_h`` (heads per program) and ``block_n`` (key tile rows) default to ``mla_decode_tiles``',
    ``num_splits`` to ``decode_num_splits`` over the head tiles."""
    _check("mla_decode_attention", q_latent=q_latent, q_rope=q_rope, cache=cache, out=out, block_tables=block_tables)
    if cache.dtype not in (q_latent.dtype, FP8_DTYPE):
        raise TypeError(f"zoo::mla_decode_attention takes a cache of q's dtype ({q_latent.dtype}) or {FP8_DTYPE}, "
                        f"got {cache.dtype}")
    batch, num_heads, rank = q_latent.shape
    rope = q_rope.shape[-1]
    if cache.shape[-1] != rank + rope:
        raise ValueError(f"zoo::mla_decode_attention: cache entries of {cache.shape[-1]} values do not hold a latent "
                         f"of {rank} and a rope key of {rope}")
    block_size = cache.shape[1]
    default_block_h, default_block_n, num_warps, num_stages = mla_decode_tiles(q_latent, cache)
    block_h, block_n = block_h or default_block_h, block_n or default_block_n
    head_tiles = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = decode_num_splits(
            batch * head_tiles, block_tables.shape[1] * block_size, q_latent.device,
            key_bytes=cache.shape[-1] * q_latent.element_size(), partial_bytes=block_h * (rank + 1) * 4,
            block_n=block_n, resident=RESIDENT_PROGRAMS)
    launch = pdl_launch(q_latent)
    # One split (a batch that fills the GPU by itself) writes the output directly.
    part_shape = (batch, num_heads, num_splits) if num_splits > 1 else (0, 0, 0)
    part_out = torch.empty(*part_shape, rank, dtype=torch.float32, device=q_latent.device)
    part_lse = torch.empty(part_shape, dtype=torch.float32, device=q_latent.device)
    block_r = _block(rank)
    _mla_decode_split_kernel[(batch, head_tiles, num_splits)](
        q_latent, q_rope, cache, block_tables, seq_lens, part_out, part_lse, out,
        scale * kv_scale * LOG2_E, float(kv_scale), num_heads,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), cache.stride(0), cache.stride(1),
        RANK=rank, ROPE=rope, BLOCK_SIZE=block_size,
        BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_ROPE=_block(rope), BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q_latent), KV_FP8=cache.dtype == FP8_DTYPE, num_warps=num_warps,
        num_stages=num_stages, **launch,
    )
    if num_splits > 1:
        _mla_decode_reduce_kernel[(batch, num_heads)](
            part_out, part_lse, seq_lens, out, out.stride(0), out.stride(1), num_splits,
            RANK=rank, BLOCK_N=block_n, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_R=block_r, num_warps=4, **launch,
        )
    return num_splits


def _prefill_tiles(q_nope: torch.Tensor, rope: int, v_dim: int) -> tuple[int, int, int, int]:
    """(query tile rows, key tile rows, warps, pipeline stages) of the prefill kernel."""
    if not q_nope.is_cuda:
        return 16, 16, 4, 2
    if q_nope.dtype == torch.float32:
        return 32, 32, 8, 2
    # 128 query rows x 64 keys on 8 warps, three stages: on DeepSeek-V3's heads the fastest of 24
    # tilings, 1.18x two stages (docs/performance.md). Wider heads (GLM-4.7-Flash's 192 + 64 query
    # and key channels, values of 256) take fewer stages, then fewer query rows, until the key
    # stages, the query tile and 16 KiB of scratch fit in a program's shared memory.
    query_row = (_block(q_nope.shape[-1]) + _block(rope)) * q_nope.element_size()
    key_row = query_row + _block(v_dim) * q_nope.element_size()
    for block_m, num_stages in ((128, 3), (128, 2), (64, 2)):
        if num_stages * 64 * key_row + block_m * query_row + (16 << 10) <= shared_memory_per_program(q_nope.device):
            return block_m, 64, 8, num_stages
    return 64, 32, 4, 1


def mla_prefill_attention_triton(q_nope, q_rope, k_nope, k_rope, v, query_start_loc, key_start_loc, max_query_len,
                                 scale, out) -> None:
    """Writes zoo::mla_prefill_attention(q_nope, ...) into ``out`` [N, H, v_dim]."""
    _check("mla_prefill_attention", q_nope=q_nope, q_rope=q_rope, k_nope=k_nope, k_rope=k_rope, v=v, out=out)
    num_heads, nope = q_nope.shape[1], q_nope.shape[2]
    rope, v_dim = q_rope.shape[2], v.shape[2]
    block_m, block_n, num_warps, num_stages = _prefill_tiles(q_nope, rope, v_dim)
    grid = (triton.cdiv(max_query_len, block_m), num_heads, query_start_loc.shape[0] - 1)
    _mla_prefill_kernel[grid](
        q_nope, q_rope, k_nope, k_rope, v, query_start_loc, key_start_loc, out, scale * LOG2_E,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), k_nope.stride(0), k_nope.stride(1),
        k_rope.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        NOPE=nope, ROPE=rope, V_DIM=v_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_NOPE=_block(nope),
        BLOCK_ROPE=_block(rope), BLOCK_V=_block(v_dim), DOT_PRECISION=_dot_precision(q_nope),
        num_warps=num_warps, num_stages=num_stages,
    )
