"""The paged KV cache's layout: the one place that allocates plain attention's K and V caches, the
layouts the CUDA kernels take, and reading entries at slots in any of them.

Every op sees a cache as [num_blocks, block_size, kv_heads, head_dim] and indexes it through its
strides. ``new_kv_cache`` decides the layout behind that view: an FP8 V cache is stored key-minor,
[num_blocks, kv_heads, head_dim, block_size], so a block's keys lie side by side for each dim. The
attention kernels' P.V product multiplies pairs of consecutive keys of V; from 16-bit rows a
transposing shared-memory load (ldmatrix.trans) pairs them, but e4m3 has none, and rows of V would be
gathered a byte at a time. The kernels read a key tile's V as its whole cache blocks instead.
"""

import torch

from ops_cuda.fp8 import FP8_DTYPE


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
