"""Reading MXFP4 weights (``ops_cuda/mxfp4.py``: uint8 blocks, two 4-bit e2m1 values a byte, the earlier
column in the low nibble, and a uint8 power-of-two scale per 32 values) inside Triton kernels: as
dequantised tiles for tensor-core products (``mxfp4_halves``, the fused-MoE kernel) and as rows times a
vector on CUDA cores (``mxfp4_rows_times_vector``, one token's expert kernels). Every value times its
scale is exact in float32 and bfloat16, so only the order of the sums differs from a product over the
dequantised weights."""

import triton
import triton.language as tl

GROUP_BYTES = tl.constexpr(16)  # a scale's 32 values


@triton.jit
def e2m1_over_2_14(codes):
    # 2^-14 times the e2m1 value of each 4-bit code (int32: sign, two exponent bits, one mantissa bit),
    # exactly, in float32: the code's bits placed as a float16's sign, lowest two exponent bits and
    # first mantissa bit (float16's exponent bias is 14 more than e2m1's; exponent 0 is subnormal in
    # both), read as that float16. Five integer operations and a conversion a value.
    bits = ((codes & 8) << 12) | ((codes & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def group_scales(exponents):
    # 2^(s - 127) * 2^14 in float32 for e8m0 exponents s (int32): the scale of values e2m1_over_2_14 gives.
    power = tl.where(exponents == 0, 2.0**-127, (exponents << 23).to(tl.float32, bitcast=True))
    return power * 16384.0


@triton.jit
def mxfp4_halves(byte_ptrs, scale_ptrs, byte_ok, scale_ok, dtype: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    # A K-step's weights in `dtype`, [BLOCK_K / 2, BLOCK_N] each: the low nibbles' (the even columns of
    # the step) and the high nibbles' (the odd), from `byte_ptrs` [BLOCK_K / 2, BLOCK_N] and their
    # groups' scales at `scale_ptrs` [BLOCK_K / 32, BLOCK_N], each read once and spread over its 16
    # bytes. Masked bytes read as zeros.
    packed = tl.load(byte_ptrs, mask=byte_ok, other=0).to(tl.int32)
    scales = group_scales(tl.load(scale_ptrs, mask=scale_ok, other=0).to(tl.int32))
    scales = tl.reshape(tl.broadcast_to(scales[:, None, :], (BLOCK_K // 32, GROUP_BYTES, BLOCK_N)),
                        (BLOCK_K // 2, BLOCK_N))
    low = e2m1_over_2_14(packed & 15) * scales
    high = e2m1_over_2_14(packed >> 4) * scales
    return low.to(dtype), high.to(dtype)


@triton.jit
def mxfp4_rows_times_vector(x_ptr, byte_row_starts, scale_row_starts, row_ok, K, ROWS: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    # [ROWS] float32: each MXFP4 weight row (its bytes from `byte_row_starts`, its scales from
    # `scale_row_starts`, both [ROWS, 1], as `row_ok`) times the K values at x_ptr, on CUDA cores. Each
    # group's 32 products are summed unscaled, then times the group's scale; the weights are read past
    # the cache (nothing else reuses them).
    half = tl.arange(0, BLOCK_K // 2)
    groups = tl.arange(0, BLOCK_K // 32)
    acc = tl.zeros([ROWS, BLOCK_K // 32], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        x_ok = 2 * half < K - start
        x_even = tl.load(x_ptr + start + 2 * half, mask=x_ok, other=0.0).to(tl.float32)
        x_odd = tl.load(x_ptr + start + 2 * half + 1, mask=x_ok, other=0.0).to(tl.float32)
        packed = tl.load(byte_row_starts + start // 2 + half[None, :], mask=row_ok & x_ok[None, :], other=0,
                         eviction_policy="evict_first").to(tl.int32)
        products = e2m1_over_2_14(packed & 15) * x_even[None, :] + e2m1_over_2_14(packed >> 4) * x_odd[None, :]
        group_sums = tl.sum(tl.reshape(products, (ROWS, BLOCK_K // 32, GROUP_BYTES)), axis=2)
        group_ok = row_ok & (groups < (K - start) // 32)[None, :]
        exponents = tl.load(scale_row_starts + start // 32 + groups[None, :], mask=group_ok, other=0)
        acc += group_sums * group_scales(exponents.to(tl.int32))
    return tl.sum(acc, axis=1)
