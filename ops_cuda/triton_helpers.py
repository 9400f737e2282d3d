"""What the Triton kernel modules of this package share: the dtype check of a launcher's inputs,
programmatic dependent launch (PDL) on Hopper and later, the rounding that follows the PyTorch
references' order of operations, the gated activations' formulas, the tensor-core K-loops of the
expert kernels (rows times a weight tile, or times a gate and an up tile), and the matrix-vector
products of single-row kernels (plain, and gated: act(gate x) * up x from interleaved gate and up rows).

This module imports triton: only kernel modules import it.
"""

import functools

import torch
import triton
import triton.language as tl

from ops_cuda.clamped_swiglu import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT
from ops_cuda.dispatch import KERNEL_DTYPES, NORM_SLOTS


def check_dtypes(op: str, *tensors: torch.Tensor) -> None:
    """Raises unless all ``tensors`` share one of ``KERNEL_DTYPES``; ``op`` names the op in the error."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or not dtypes <= set(KERNEL_DTYPES):
        raise TypeError(
            f"the CUDA kernel of zoo::{op} takes one of {KERNEL_DTYPES} for all inputs, got {sorted(map(str, dtypes))}"
        )


def bias_or(bias: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """A kernel's bias argument: the bias, contiguous, or without one ``stand_in``, which a kernel
    launched with HAS_BIAS false never reads."""
    return stand_in if bias is None else bias.contiguous()


# Whether kernels use programmatic dependent launch where the GPU has it. `profile_decode.py
# --without-pdl` turns it off: under it the profiler's kernel times include each kernel's wait for the
# one before, and do not add up.
PDL_ENABLED = True


def pdl(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device use programmatic dependent launch (Hopper and later): a
    kernel is started while the ones before it still run, and waits for their results inside
    (``begin_after_previous``). A decode step is a chain of short kernels: this hides their starts."""
    return PDL_ENABLED and t.is_cuda and _compute_capability(t.device)[0] >= 9


def pdl_launch(t: torch.Tensor) -> dict[str, bool]:
    """The launch arguments of a kernel that begins with ``begin_after_previous``: its PDL flag and
    the launch option together, so a kernel started early always waits for the one before."""
    enabled = pdl(t)
    return {"PDL": enabled, "launch_pdl": enabled}


@functools.cache
def _compute_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def resident_programs(kernel, device: torch.device) -> int:
    """How many programs of ``kernel`` (compiled: ``warmup``'s result) the GPU holds at once: per SM, as
    many as its registers, threads and shared memory allow. Registers are allocated per warp in units
    of 256; Triton reports the register file (64K on every NVIDIA GPU since Volta) as a block's most."""
    kernel._init_handles()  # loads it: the registers it takes are known from then on
    properties = torch.cuda.get_device_properties(device)
    warps = kernel.metadata.num_warps
    register_file = triton.runtime.driver.active.utils.get_device_properties(device.index)["max_num_regs"]
    per_sm = min(register_file // (-(-kernel.n_regs * 32 // 256) * 256 * warps),
                 properties.max_threads_per_multi_processor // (32 * warps),
                 properties.shared_memory_per_multiprocessor // max(kernel.metadata.shared, 1))
    return properties.multi_processor_count * per_sm


def fullest_tile(tiles, programs, slots, preferred: int) -> int:
    """Of a kernel's ``tiles``, each launched as ``programs(tile)`` programs of which the GPU holds
    ``slots(tile)`` at once, the one that leaves the fewest slots idle over the launch, its last
    partial wave counted as a whole one: 1.45 waves of programs leave 27% of their two waves' slots
    idle, 1.94 waves 3%. A product that streams its weight once loses about that share of its
    bandwidth in the tail. Ties go to ``preferred``."""
    def idle_share(tile):
        count, held = programs(tile), slots(tile)
        return 1 - count / (-(-count // held) * held), tile != preferred

    return min(tiles, key=idle_share)


@triton.jit
def begin_after_previous(PDL: tl.constexpr):
    # Under PDL the previous kernel may still be running. Let the next kernel start now: its
    # programs take the SMs this one leaves idle and read their first weights while the kernels
    # before still run. Then wait for all of the previous kernel's writes before this kernel reads
    # or writes activations. Before that wait a kernel reads only what no kernel of the step
    # writes: weights, the step's attention metadata (lengths, block tables, slots), which the
    # runtime writes before the step's first kernel, and the KV cache's entries of earlier steps
    # (never the step's own key). Every program waits, so a finished kernel implies finished
    # predecessors, however early each was started.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def begin_after_previous_holding_next(PDL: tl.constexpr):
    # As begin_after_previous, but the next kernel starts only once the previous one has finished:
    # for a kernel whose successor reads, before its own wait, what the previous kernel wrote.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def round_to(x, dtype: tl.constexpr):
    # Round a float32 value to `dtype` and back: where the reference materialises an intermediate.
    return x.to(dtype).to(tl.float32)


@triton.jit
def tanh(x):
    # No tanh in core triton (nor in the interpreter): from exp(-2|x|), which cannot overflow.
    e = tl.exp(-2.0 * tl.abs(x))
    magnitude = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -magnitude, magnitude)


# HuggingFace `hidden_act` names -> the formula ``gated_activation`` computes (``apply_activation``'s
# act(gate) * up, or clamped_swiglu's).
KERNEL_ACTIVATIONS = {
    "silu": "silu", "swish": "silu", "gelu": "gelu_erf",
    "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "relu": "relu", "clamped_swiglu": "clamped_swiglu",
}
# Kernels read module globals only as constexprs.
_SWIGLU_ALPHA = tl.constexpr(CLAMPED_SWIGLU_ALPHA)
_SWIGLU_LIMIT = tl.constexpr(CLAMPED_SWIGLU_LIMIT)


@triton.jit
def apply_activation(x, ACTIVATION: tl.constexpr):
    # The formulas of PyTorch's CUDA kernels, in float32.
    if ACTIVATION == "silu":
        return x / (1.0 + tl.exp(-x))
    elif ACTIVATION == "gelu_erf":
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + tanh(inner))
    else:  # relu; `where` rather than `maximum` so NaN propagates as in torch.relu
        return tl.where(x < 0.0, 0.0, x)


@triton.jit
def expert_bias(bias_ptr, experts, cols, mask, width):
    # float32 biases of `experts` at `cols` (shapes that broadcast) from experts' biases [E, width],
    # contiguous; zeros where `mask` is false, as it must be for an expert below zero.
    return tl.load(bias_ptr + experts * width + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_gated_activation(h_ptrs, mask, gate, up, bias_ptr, expert, cols, col_ok, intermediate,
                           HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    # act(gate) * up stored at h_ptrs in their dtype from an expert's float32 gate and up products
    # [rows, cols], each first plus its row's bias (HAS_BIAS; the gate row's and the up row's of biases
    # [E, 2I]) before the rounding, as F.linear adds them.
    if HAS_BIAS:
        gate += expert_bias(bias_ptr, expert, cols, col_ok, 2 * intermediate)[None, :]
        up += expert_bias(bias_ptr, expert, intermediate + cols, col_ok, 2 * intermediate)[None, :]
    dtype = h_ptrs.dtype.element_ty
    tl.store(h_ptrs, gated_activation(gate, up, dtype, ACTIVATION).to(dtype), mask=mask)


@triton.jit
def tile_products(x_ptrs, w_ptrs, row_ok, col_ok, K, w_stride_k, acc, DOT_PRECISION: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    # acc + x w over K on tensor cores: x_ptrs [rows, BLOCK_K] at the rows' first values (unit stride
    # along K), w_ptrs [BLOCK_K, cols] at the weight's first step (w_stride_k apart along K); rows and
    # cols outside row_ok / col_ok read as zeros.
    ks = tl.arange(0, BLOCK_K)
    for k in range(0, K, BLOCK_K):
        k_ok = ks < K - k
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * w_stride_k
    return acc


@triton.jit
def gate_up_tile_products(x_ptrs, gate_ptrs, up_ptrs, row_ok, col_ok, K, w_stride_k, gate, up,
                          DOT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    # `tile_products` of the same rows x with a gate and an up weight tile, x read once a step.
    ks = tl.arange(0, BLOCK_K)
    for k in range(0, K, BLOCK_K):
        k_ok = ks < K - k
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        gate = tl.dot(x, tl.load(gate_ptrs, mask=w_ok, other=0.0), gate, input_precision=DOT_PRECISION)
        up = tl.dot(x, tl.load(up_ptrs, mask=w_ok, other=0.0), up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K * w_stride_k
        up_ptrs += BLOCK_K * w_stride_k
    return gate, up


@triton.jit
def weight_tile(row_starts, row_ok, cols, K):
    # Columns `cols` of the rows of a row-major weight that start at `row_starts` (any shape ending
    # in 1, [rows, 1] or [experts, rows, 1]; `row_ok` the same shape), read past the cache: nothing
    # else reuses it.
    return tl.load(row_starts + cols, mask=row_ok & (cols < K), other=0.0, eviction_policy="evict_first")


@triton.jit
def rows_times_vector(x_ptr, row_starts, row_ok, K, first_tile, BLOCK_K: tl.constexpr):
    # [rows] float32: each weight row times the K values at x_ptr, on CUDA cores (one row gives a
    # tensor-core tile nothing but padding); `row_starts` and `row_ok` [rows, 1] as `weight_tile`
    # takes them. `first_tile` holds the rows' first BLOCK_K columns,
    # already read (a caller may read it before waiting on the previous kernel). Products
    # accumulate elementwise in float32 and are summed once at the end.
    cols = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
    acc = first_tile.to(tl.float32) * x[None, :].to(tl.float32)
    for start in range(BLOCK_K, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        w = weight_tile(row_starts, row_ok, cols, K)
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
        acc += w.to(tl.float32) * x[None, :].to(tl.float32)
    return tl.sum(acc, axis=1)


_NORM_SLOTS = tl.constexpr(NORM_SLOTS)


@triton.jit
def add_squares(stats_ptr, values):
    # Adds the sum of squares of this program's float32 `values` into a split norm's sums (ops_cuda.gemv):
    # program p into slot p % NORM_SLOTS, so that few atomic adds meet at one address.
    total = tl.sum(values * values, axis=0).to(tl.float64)
    tl.atomic_add(stats_ptr + tl.program_id(0) % _NORM_SLOTS, total, sem="relaxed")


@triton.jit
def store_into_norm(out, rows, row_ok, residual_ptr, norm_weight, summed_ptr, weighted_ptr, stats_ptr):
    # The first half of the split RMSNorm after a product (ops_cuda.gemv): its rows `out` (float32, as
    # the reference writes them in the activations' dtype) plus the residual (summed, the new residual),
    # summed times the norm's weight (weighted), and the rows' sum of squares added into the norm's slots.
    dtype = summed_ptr.dtype.element_ty
    residual = tl.load(residual_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    summed = round_to(out + residual, dtype)
    tl.store(summed_ptr + rows, summed.to(dtype), mask=row_ok)
    tl.store(weighted_ptr + rows, (summed * norm_weight).to(dtype), mask=row_ok)
    add_squares(stats_ptr, summed)


@triton.jit
def norm_squares(stats_ptr):
    # A split norm's slots, loaded where a consumer's weights have not started to stream: the load
    # runs beside them, and inverse_rms sums it after the products (a sum read first holds every
    # load behind it until the slots arrive).
    return tl.load(stats_ptr + tl.arange(0, _NORM_SLOTS))


@triton.jit
def inverse_rms(squares, hidden, eps):
    # 1 / rms of a row of `hidden` values whose sums of squares `squares` holds (norm_squares').
    return tl.math.rsqrt(tl.sum(squares, axis=0).to(tl.float32) / hidden + eps)


@triton.jit
def weighted_slot_sum(y, weights_ptr, slots, slot_ok, dtype: tl.constexpr, BLOCK_SLOTS: tl.constexpr):
    # [rows] float32: a token's expert outputs y [slots, rows] (float32 products), each rounded to
    # `dtype` as the reference writes it, times its routing weight, summed slot by slot in order: the
    # reference's combine.
    weighted = round_to(y, dtype) * tl.load(weights_ptr + slots, mask=slot_ok, other=0.0)[:, None]
    out = tl.zeros([y.shape[1]], dtype=tl.float32)
    for k in tl.static_range(BLOCK_SLOTS):
        out += tl.sum(tl.where(slots[:, None] == k, weighted, 0.0), axis=0)
    return out


@triton.jit
def gated_weight_rows(first_col, intermediate, BLOCK_N: tl.constexpr):
    # The weight rows behind columns first_col.. of h = act(gate x) * up x for a weight of gate rows
    # then as many up rows: [2 * BLOCK_N] rows, each column's gate row then its up row (I rows
    # further), so that one tile holds both; and the column of each of those rows.
    lanes = tl.arange(0, 2 * BLOCK_N)
    cols = first_col + lanes // 2
    return cols + (lanes % 2) * intermediate, cols


@triton.jit
def gated_rows_times_vector(x_ptr, row_starts, row_ok, K, first_tile, bias, squares, eps, dtype: tl.constexpr,
                            ACTIVATION: tl.constexpr, NORMED: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    # [BLOCK_N] float32: act(gate x) * up x (or the other gated form of ACTIVATION) from the rows of
    # `gated_weight_rows` (`first_tile`: their first BLOCK_K columns, already read), plus `bias` (one
    # value per row, or 0.0), with the reference's rounding (`gated_activation`). NORMED: x is a split
    # norm's weighted row, the products are scaled by the 1 / rms of `squares` (norm_squares').
    products = rows_times_vector(x_ptr, row_starts, row_ok, K, first_tile, BLOCK_K)
    if NORMED:
        products *= inverse_rms(squares, K, eps)
    return interleaved_gated_activation(products + bias, dtype, ACTIVATION, BLOCK_N)


@triton.jit
def interleaved_gated_activation(products, dtype: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_N: tl.constexpr):
    # [BLOCK_N] gated_activation of the [2 * BLOCK_N] float32 products of `gated_weight_rows`' rows (each
    # column's gate row, then its up row).
    gate, up = tl.split(tl.reshape(products, [BLOCK_N, 2]))
    return gated_activation(gate, up, dtype, ACTIVATION)


@triton.jit
def gated_activation(gate, up, dtype: tl.constexpr, ACTIVATION: tl.constexpr):
    # act(gate) * up (or clamped_swiglu) in float32 from float32 gate and up values, rounded where the
    # reference rounds: gate and up to `dtype` (a product the reference writes in it; values read
    # from it are already exact), then each intermediate the reference writes. The result's own
    # rounding is the caller's store.
    if ACTIVATION == "clamped_swiglu":
        return clamped_swiglu(round_to(gate, dtype), round_to(up, dtype), dtype)
    else:
        return round_to(apply_activation(round_to(gate, dtype), ACTIVATION), dtype) * round_to(up, dtype)


@triton.jit
def clamped_swiglu(gate, up, dtype: tl.constexpr):
    # GPT-OSS's (up + 1) * gate * sigmoid(alpha * gate), gate clamped from above and up from both sides,
    # from values already in `dtype`: the clamps are exact, and each later op's result is rounded to
    # `dtype` as the reference's ops in that dtype round it (alpha * gate, the sigmoid, the glu, up + 1).
    gate = tl.minimum(gate, _SWIGLU_LIMIT)
    up = tl.minimum(tl.maximum(up, -_SWIGLU_LIMIT), _SWIGLU_LIMIT)
    sigmoid = round_to(1.0 / (1.0 + tl.exp(-round_to(gate * _SWIGLU_ALPHA, dtype))), dtype)
    return round_to(up + 1.0, dtype) * round_to(gate * sigmoid, dtype)
