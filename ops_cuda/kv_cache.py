"""Writing new keys and values into the paged KV cache through the slot mapping, and reading
entries back.

A cache holds each value divided by its per-tensor scale (``k_scale``, ``v_scale``), in the cache's
dtype: the model's dtype (scale 1.0), or float8_e4m3fn, where the quotient is saturated to ±448
before rounding (a cast alone would turn values past the range into NaN). Reading multiplies by the
scale again (``dequantize``; the attention kernels fold it into their scores and outputs). The
caches' layout is ``ops_cuda/kv_layout.py``'s.
"""

import torch

from ops_cuda.dispatch import cuda_implementation, public_op
from ops_cuda.fp8 import FP8_DTYPE, FP8_MAX


def quantize(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``cache_dtype`` with per-tensor ``scale`` stores it."""
    if cache_dtype == FP8_DTYPE:
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)
    return (x if scale == 1.0 else x / scale).to(cache_dtype)


def holds_exactly(cache: torch.Tensor, dtype: torch.dtype, *scales: float) -> bool:
    """Whether ``cache`` with these per-tensor scales reads back values of ``dtype`` unrounded: a
    cache of that dtype at scale 1.0. Only then may attention take new keys and values as given
    rather than as their entries."""
    return cache.dtype == dtype and all(scale == 1.0 for scale in scales)


def dequantize(entries: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache ``entries`` as the values of ``dtype`` they stand for."""
    entries = entries.to(dtype)
    return entries if scale == 1.0 else entries * scale


def write_kv_cache_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
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


write_kv_cache_op = torch.library.custom_op("zoo::write_kv_cache", write_kv_cache_reference,
                                            mutates_args=("k_cache", "v_cache"))


@cuda_implementation(write_kv_cache_op)
def _(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    from ops_cuda.triton_kernels import write_kv_cache_triton  # triton is imported only where a kernel runs

    write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


write_kv_cache = public_op(write_kv_cache_op, write_kv_cache_reference)
