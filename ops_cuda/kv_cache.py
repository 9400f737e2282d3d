"""Writing new keys and values into the paged KV cache through the slot mapping."""

import torch

from ops_cuda.dispatch import reference_on_cpu


def write_kv_cache_reference(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Writes k/v [N, Hkv, D] into the caches at slot_mapping [N], in place; slots < 0 are skipped.

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
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v


@torch.library.custom_op("zoo::write_kv_cache", mutates_args=("k_cache", "v_cache"))
def write_kv_cache_op(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    write_kv_cache_reference(k, v, k_cache, v_cache, slot_mapping)


@write_kv_cache_op.register_kernel("cuda")
def _(k, v, k_cache, v_cache, slot_mapping):
    from ops_cuda.triton_kernels import write_kv_cache_triton  # triton is imported only where a kernel runs

    write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)


write_kv_cache = reference_on_cpu(write_kv_cache_op, write_kv_cache_reference)
