"""Writing new keys and values into the paged KV cache through the slot mapping, and reading
entries back.

A cache holds each value divided by its per-tensor scale (``k_scale``, ``v_scale``), in the cache's
dtype: the model's dtype (scale 1.0), or float8_e4m3fn, where the quotient is saturated to ±448
before rounding (a cast alone would turn values past the range into NaN). Reading multiplies by the
scale again (``dequantize``; the attention kernels fold it into their scores and outputs).

Every op sees a cache as [num_blocks, block_size, kv_heads, head_dim] and indexes it through its
strides. ``new_kv_cache`` decides the layout behind that view: an FP8 V cache is stored key-minor,
[num_blocks, kv_heads, head_dim, block_size], so a block's keys lie side by side for each dim. The
decode kernel's P.V product multiplies pairs of consecutive keys of V; from 16-bit rows a transposing
shared-memory load (ldmatrix.trans) pairs them, but e4m3 has none, and rows of V would be gathered a
byte at a time.
"""

import torch

from ops_cuda.dispatch import reference_on_cpu
from ops_cuda.fp8 import FP8_DTYPE, FP8_MAX


def new_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty K and V caches [num_blocks, block_size, num_kv_heads, head_dim] of ``dtype``; an FP8 V
    cache is key-minor behind that view (see the module's docstring)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device=device)
    if dtype != FP8_DTYPE:
        return k_cache, torch.empty(shape, dtype=dtype, device=device)
    rows = torch.empty((num_blocks, num_kv_heads, head_dim, block_size), dtype=dtype, device=device)
    return k_cache, rows.permute(0, 3, 1, 2)


def is_key_minor(cache: torch.Tensor) -> bool:
    """Whether ``cache`` [blocks, block_size, heads, D] holds a block's keys side by side (an FP8 V
    cache of ``new_kv_cache``), not each key's row of D."""
    return cache.stride(-1) != 1 and cache.stride(1) == 1


def check_cache_layout(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The layouts the CUDA kernels of ``op`` take: each key's row of D contiguous, or for V also
    key-minor (``new_kv_cache``)."""
    if k_cache.stride(-1) != 1:
        raise ValueError(f"zoo::{op} needs k_cache with a unit stride on its last dim, got strides {k_cache.stride()}")
    if v_cache.stride(-1) != 1 and not is_key_minor(v_cache):
        raise ValueError(f"zoo::{op} needs v_cache with a unit stride on its last dim (head_dim) or on its "
                         f"slot dim (key-minor), got strides {v_cache.stride()}")


def read_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache``'s entries [len(slots), heads, D] at ``slots`` (block * block_size + offset), in any
    layout."""
    block_size = cache.shape[1]
    if cache.stride(0) == block_size * cache.stride(1):  # the blocks flatten into a view: the fastest read on CPU
        return cache.flatten(0, 1).index_select(0, slots)
    return cache[slots // block_size, slots % block_size]


def quantize(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``cache_dtype`` with per-tensor ``scale`` stores it."""
    if cache_dtype == FP8_DTYPE:
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)
    return (x if scale == 1.0 else x / scale).to(cache_dtype)


def dequantize(entries: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache ``entries`` as the values of ``dtype`` they stand for."""
    entries = entries.to(dtype)
    return entries if scale == 1.0 else entries * scale


def write_kv_cache_reference(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    """Writes k/v [N, Hkv, D] into the caches at slot_mapping [N], in place, k divided by ``k_scale``
    and v by ``v_scale`` (see the module's docstring); slots < 0 are skipped.

    The reference selects the valid slots with a boolean mask, a host sync; the CUDA kernel masks
    on the device, so only it can be captured in a CUDA graph.
    """
    # k/v: [N, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]; slot = block * block_size + offset.
    # Slot -1 marks a padding token of a captured batch: nothing is written for it. Finding one
    # reads the host, which a graph torch.compile traces cannot: there padding tokens come with a
    # real slot that nothing reads (the runtime's padding block, see CompiledDecode).
    if not torch.compiler.is_compiling() and not bool((slot_mapping >= 0).all()):  # rare: select only then
        valid = slot_mapping >= 0
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    blocks, offsets = slot_mapping // k_cache.shape[1], slot_mapping % k_cache.shape[1]
    k_cache[blocks, offsets] = quantize(k, k_scale, k_cache.dtype)
    v_cache[blocks, offsets] = quantize(v, v_scale, v_cache.dtype)


@torch.library.custom_op("zoo::write_kv_cache", mutates_args=("k_cache", "v_cache"))
def write_kv_cache_op(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    write_kv_cache_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@write_kv_cache_op.register_kernel("cuda")
def _(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    from ops_cuda.triton_kernels import write_kv_cache_triton  # triton is imported only where a kernel runs

    write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


write_kv_cache = reference_on_cpu(write_kv_cache_op, write_kv_cache_reference)
