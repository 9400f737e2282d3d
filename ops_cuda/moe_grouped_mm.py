"""The grouped-GEMM kernel of ``zoo::moe_experts``: the (token, slot) pairs sorted by expert, the experts'
two matmuls as PyTorch's grouped GEMM (``torch._grouped_mm``, CUTLASS on sm90/sm100), two small Triton
kernels around them. The op's dispatch (``ops_cuda/moe.py``) runs it from ``GROUPED_MM_MIN_PAIRS`` pairs
on; below that the Triton fused-MoE kernel (``ops_cuda/moe_triton.py``) runs, sharing this file's sort
of the pairs (``sort_pairs_by_expert``) and its combine (``moe_combine``).

    sorted_ids, order = (topk_ids as E where -1).flatten().sort(stable=True)   # pairs in expert order
    offsets = searchsorted(sorted_ids, 0..E-1, right=True)      # int32 end of each expert's rows
    x = hidden[order // top_k]                                  # permute (Triton), also inverts `order`
    h = act_and_mul_triton(grouped_mm(x, gate_up^T, offsets))   # [pairs, I]
    y = grouped_mm(h, down^T, offsets)                          # [pairs, H]
    out[t] = sum_k w[t, k] * y[position of (t, k)]              # combine (Triton), float32, k in order,
                                                                #   skipping the pairs of id -1

Everything is sized by the number of pairs, never by how they fall on the experts, and nothing reads
a device value on the host (no ``.item()``, no ``bincount``: CUDA's bincount reads its input's max on
the host), so the op runs under CUDA-graph capture as it runs eagerly. The combine is a gather, summed
over k in a fixed order, not a scatter-add: results do not depend on atomics or on the batch around a
token.

What ``torch._grouped_mm`` (torch 2.8 onward, same schema through 2.13) needs for its fast path, from
``aten/src/ATen/native/cuda/GroupedBlas.cpp`` and ``GroupedMMUtils.h``; the dispatch sends anything
else to the Triton kernel (``grouped_mm_supported``), and experts with biases too (its bf16 output
would round each product before the bias is added):
- bf16 operands and output (no ``out_dtype``), on a device of compute capability 9.x or 10.x. Other
  dtypes or devices take ``_grouped_mm_fallback``, which copies the offsets to the host: a sync per
  call, and not capturable.
- 2D ``mat_a`` [rows, K] with ``offs`` (int32, cumulative ends, one per group; empty groups allowed),
  3D ``mat_b`` [groups, K, N]: each operand either row- or column-major in its last two dims, the
  leading stride a multiple of 16 bytes, the data pointer 16-byte aligned. ``gate_up.transpose(-2, -1)``
  ([E, H, 2I], strides (2I*H, 1, H)) is the column-major case: no copy of the weights, as long as
  H and I are multiples of 8 elements.
- fewer than 1024 groups. Rows past ``offs[-1]`` are left unwritten (here the pairs of id -1, sorted last).
"""

import functools

import torch
import triton
import triton.language as tl

from ops_cuda.triton_helpers import round_to
from ops_cuda.triton_kernels import act_and_mul_triton

_MAX_GROUPS = 1024  # the CUTLASS kernel's limit on the number of groups (experts)
_ALIGN = 8  # bf16 elements in 16 bytes: TMA's alignment for leading strides and base pointers


@functools.lru_cache(maxsize=None)
def _has_grouped_gemm_kernel(device_index: int) -> bool:
    # torch gates its CUTLASS grouped GEMM on _scaled_mm_allowed_device(sm90_only, sm100_only).
    return torch.cuda.get_device_capability(device_index)[0] in (9, 10)


def _transposable(weight: torch.Tensor) -> bool:
    """Whether ``weight [E, out, in].transpose(-2, -1)`` is a valid column-major ``mat_b``."""
    out_features, in_features = weight.shape[-2:]
    return (
        weight.stride(-1) == 1
        and weight.stride(-2) >= max(1, in_features)
        and weight.stride(0) % _ALIGN == 0  # each expert's matrix starts 16-byte aligned
        and weight.stride(-2) % _ALIGN == 0
        and weight.data_ptr() % 16 == 0
        and out_features > 0
    )


def grouped_mm_supported(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the grouped-GEMM kernel takes these inputs (else the op runs the Triton kernel)."""
    if not (hidden.dtype == gate_up.dtype == down.dtype == torch.bfloat16):
        return False  # fp16 / fp32: torch would loop over matmuls after a host sync
    if not (hidden.is_cuda and _has_grouped_gemm_kernel(hidden.device.index)):
        return False
    num_experts, two_i, hidden_size = gate_up.shape
    intermediate = down.shape[-1]
    return (
        num_experts < _MAX_GROUPS
        and hidden.dim() == 2
        and hidden.shape[1] == hidden_size
        and hidden_size % _ALIGN == 0
        and intermediate % _ALIGN == 0
        and two_i == 2 * intermediate
        and _transposable(gate_up)
        and _transposable(down)
    )


def sort_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [P]: the pair indices t * top_k + k grouped by expert, offsets [E] int32: the end of each
    expert's run in ``order``, i.e. the number of pairs routed to experts 0..e). Pairs of id -1 (an
    expert on another rank) come last, past every expert's run. Shared by both kernels."""
    # Stable, so the rows of one expert keep token order (not needed for the result: each row of a
    # GEMM depends on its own input row only; it keeps every launch's data layout reproducible).
    ids = topk_ids.reshape(-1)
    sorted_ids, order = torch.where(ids < 0, num_experts, ids).sort(stable=True)
    experts = torch.arange(num_experts, dtype=sorted_ids.dtype, device=topk_ids.device)
    return order, torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)


# ---------------------------------------------------------------------------------------------
# Triton: permute the hidden rows into expert order, and combine the experts' outputs per token
# ---------------------------------------------------------------------------------------------


@triton.jit
def _moe_permute_kernel(
    hidden_ptr, order_ptr, x_ptr, position_ptr, hidden_size, hidden_stride, x_stride,
    TOP_K: tl.constexpr, BLOCK: tl.constexpr,
):
    # Program (j, c): row j of the expert-ordered input is the hidden row of pair order[j]; the
    # first column block also records where that pair landed (the inverse permutation).
    j = tl.program_id(0).to(tl.int64)
    pair = tl.load(order_ptr + j).to(tl.int64)
    token = pair // TOP_K
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden_size
    row = tl.load(hidden_ptr + token * hidden_stride + cols, mask=mask)
    tl.store(x_ptr + j * x_stride + cols, row, mask=mask)
    if tl.program_id(1) == 0:
        tl.store(position_ptr + pair, j.to(tl.int32))


@triton.jit
def _moe_combine_kernel(
    y_ptr, position_ptr, weights_ptr, ids_ptr, out_ptr, hidden_size, y_stride, weights_stride, ids_stride,
    out_stride, TOP_K: tl.constexpr, BLOCK: tl.constexpr, SHARED: tl.constexpr,
):
    # Program (t, c): out[t] = sum over k, in order, of weight[t, k] * y[position of pair (t, k)], in float32.
    # A pair of id -1 adds nothing: its row of y was never written, and the sum skips it by its id. With SHARED, the
    # shared expert's pair of the token (numbered after all the routed pairs) is added unweighted to
    # that sum rounded to out's dtype.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden_size
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + token * ids_stride + k)
        row = tl.load(position_ptr + token * TOP_K + k).to(tl.int64)
        weight = tl.load(weights_ptr + token * weights_stride + k).to(tl.float32)
        held = mask & (cols * 0 + expert >= 0)  # a vector: Triton's interpreter takes no scalar into a mask
        y = tl.load(y_ptr + row * y_stride + cols, mask=held, other=0.0).to(tl.float32)
        acc += y * weight
    if SHARED:
        row = tl.load(position_ptr + tl.num_programs(0) * TOP_K + token).to(tl.int64)
        acc = round_to(acc, out_ptr.dtype.element_ty) + tl.load(y_ptr + row * y_stride + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + token * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _block(hidden_size: int) -> int:
    return min(triton.next_power_of_2(hidden_size), 1024)


def moe_permute(hidden: torch.Tensor, order: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [P, H] with x[j] = hidden[order[j] // top_k], position [P] int32 with position[order[j]] = j)."""
    pairs, hidden_size = order.shape[0], hidden.shape[1]
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    x = torch.empty(pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    position = torch.empty(pairs, dtype=torch.int32, device=hidden.device)
    block = _block(hidden_size)
    _moe_permute_kernel[(pairs, triton.cdiv(hidden_size, block))](
        hidden, order, x, position, hidden_size, hidden.stride(0), x.stride(0),
        TOP_K=top_k, BLOCK=block, num_warps=4,
    )
    return x, position


def moe_combine(
    y: torch.Tensor, position: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, dtype: torch.dtype,
    shared: bool = False,
) -> torch.Tensor:
    """out [N, H] (dtype) with out[t] = sum_k topk_weights[t, k] * y[position[t * top_k + k]], in float32,
    over the slots whose ``topk_ids`` are not -1. ``shared``: plus y[position[N * top_k + t]], a shared
    expert's output, added unweighted to that sum once it is rounded to ``dtype``."""
    num_tokens, top_k = topk_weights.shape
    hidden_size = y.shape[1]
    weights = topk_weights.to(torch.float32).contiguous()
    if y.stride(-1) != 1:
        y = y.contiguous()
    out = torch.empty(num_tokens, hidden_size, dtype=dtype, device=y.device)
    block = _block(hidden_size)
    _moe_combine_kernel[(num_tokens, triton.cdiv(hidden_size, block))](
        y, position, weights, topk_ids, out, hidden_size, y.stride(0), weights.stride(0), topk_ids.stride(0),
        out.stride(0),
        TOP_K=top_k, BLOCK=block, SHARED=shared, num_warps=4,
    )
    return out


# ---------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------


def moe_experts_grouped_mm(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """``zoo::moe_experts`` with grouped GEMMs; the caller checks ``grouped_mm_supported`` first."""
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:  # a static shape: no launch has anything to do
        return hidden.new_zeros(num_tokens, hidden_size)
    order, offsets = sort_pairs_by_expert(topk_ids, gate_up.shape[0])
    x, position = moe_permute(hidden, order, top_k)
    h = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offsets)  # [P, 2I], bf16 (fp32 accumulate)
    h = act_and_mul_triton(h, activation)  # [P, I]
    y = torch._grouped_mm(h, down.transpose(-2, -1), offs=offsets)  # [P, H]
    return moe_combine(y, position, topk_weights, topk_ids, hidden.dtype)
