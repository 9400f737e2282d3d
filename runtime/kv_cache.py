"""The paged KV cache: how many blocks the memory holds, and the pools the model's layers attend over."""

import gc
import math
import weakref

import torch

from layers import AttentionMetadata
from layers.linear import available_memory
from ops_cuda.fp8 import FP8_CUDA_CAPABILITY, FP8_DTYPE
from ops_cuda.kv_layout import new_kv_cache
from runtime.config import EngineConfig

CPU_KV_CACHE_GIB = 1.0


def cache_dtype(kv_cache_dtype: str, model) -> torch.dtype:
    """The dtype of the pools for ``EngineConfig.kv_cache_dtype`` (checked there): the model's for
    "auto", float8_e4m3fn for "fp8" where the device takes it."""
    parameter = next(model.parameters())
    if kv_cache_dtype == "auto":
        return parameter.dtype
    device = parameter.device
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CUDA_CAPABILITY:
        name, capability = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
        needed, got = ".".join(map(str, FP8_CUDA_CAPABILITY)), ".".join(map(str, capability))
        raise ValueError(f"kv_cache_dtype='fp8' needs a CUDA device of compute capability {needed} or later; "
                         f"{name} is {got}")
    return FP8_DTYPE


def bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    """The bytes one block of ``block_size`` tokens takes over all of the model's cache pools of ``dtype``."""
    per_token = sum(math.prod(shape) for layer in model.kv_cache_spec() for shape in layer)
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


def blocks_for_budget(model, config: EngineConfig, dtype: torch.dtype, host_ranks: int) -> int:
    """The blocks of a KV cache of ``dtype`` (``cache_dtype``) for a resolved ``config``: its
    ``kv_cache_gib``; else on CUDA the device's memory times ``gpu_memory_utilization``, less the
    peak that a profiling forward of the largest step allocated; else ``CPU_KV_CACHE_GIB``. Never
    more than max_num_seqs sequences of max_model_len tokens need. ``host_ranks`` ranks share the
    budget (CPU tensor parallelism: they share the host's memory), each with a cache of its KV heads."""
    parameter = next(model.parameters())
    device = parameter.device
    if config.kv_cache_gib is not None:
        budget = config.kv_cache_gib * (1 << 30)
    elif device.type == "cuda":
        gc.collect()  # an earlier engine of this model, dropped but in a reference cycle, frees its cache
        # The largest step: max_num_batched_tokens new tokens, as prompts of at most max_model_len tokens.
        length = min(config.max_num_batched_tokens, config.max_model_len)
        batch = -(-config.max_num_batched_tokens // length)
        positions = torch.arange(length, device=device).repeat(batch)
        last_tokens = torch.arange(1, batch + 1, device=device) * length - 1
        torch.cuda.reset_peak_memory_stats(device)
        with torch.inference_mode():
            model(torch.zeros_like(positions), positions, AttentionMetadata.causal_prefill(batch, length),
                  logits_indices=last_tokens)
        total = torch.cuda.mem_get_info(device)[1]
        budget = total * config.gpu_memory_utilization - torch.cuda.max_memory_allocated(device)
    else:
        budget = CPU_KV_CACHE_GIB * (1 << 30)
    budget /= host_ranks
    useful = config.max_num_seqs * blocks_per_sequence(config)
    block_bytes = bytes_per_block(model, config.block_size, dtype)
    num_blocks = min(int(budget // block_bytes), useful)
    if num_blocks < 1:
        raise ValueError(f"no memory left for the KV cache: a block of block_size={config.block_size} tokens takes "
                         f"{block_bytes} bytes, the budget is {int(budget)} bytes")
    return num_blocks


def blocks_per_sequence(config: EngineConfig) -> int:
    """The blocks one sequence of max_model_len tokens takes."""
    return -(-config.max_model_len // config.block_size)


def check_sizes(model, config: EngineConfig, num_blocks: int, dtype: torch.dtype, padding_block: bool,
                host_ranks: int) -> None:
    """Refuse a cache of ``num_blocks`` that cannot hold one sequence of ``max_model_len`` tokens, or
    pools and per-sequence buffers larger than the memory left (on the host, those of all
    ``host_ranks`` ranks that share it), before any of it is allocated: a request would fail
    halfway, an allocator would not name the option."""
    needed = blocks_per_sequence(config)
    if num_blocks < needed:
        raise ValueError(f"max_model_len={config.max_model_len} does not fit the KV cache: {num_blocks} blocks of "
                         f"block_size={config.block_size} hold {num_blocks * config.block_size} tokens; give at "
                         f"least {needed} blocks (num_blocks, kv_cache_gib, gpu_memory_utilization) or "
                         f"max_model_len <= {num_blocks * config.block_size}")
    device = next(model.parameters()).device
    pools = (num_blocks + padding_block) * bytes_per_block(model, config.block_size, dtype)
    tables = config.max_num_seqs * (needed * 4 + 8)  # a block-table row (int32) and a sampled id (int64) each
    left = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()
    if left is not None and pools * host_ranks > left:
        ranks = f" on each of {host_ranks} ranks" if host_ranks > 1 else ""
        raise ValueError(f"the KV cache's {num_blocks} blocks of block_size={config.block_size} tokens take {pools} "
                         f"bytes{ranks}, more than the {left} bytes of memory left: lower num_blocks, kv_cache_gib "
                         f"or block_size")
    host_left = left if device.type != "cuda" else available_memory()
    if host_left is not None and tables > host_left:
        raise ValueError(f"max_num_seqs={config.max_num_seqs} asks for {tables} bytes of per-sequence buffers, "
                         f"more than the {host_left} bytes of memory left")


class KVCache:
    """Per layer of ``model.kv_cache_spec()``, a pool of fixed-size blocks per entry:
    [num_blocks, block_size, *shape] (K and V of [kv_heads, head_dim] for plain attention, laid out
    by ``ops_cuda.kv_layout.new_kv_cache``), bound to the model with the attention ``backend``. The
    pools are ``dtype`` (None: the model's; ``cache_dtype`` resolves ``EngineConfig.kv_cache_dtype``);
    the layers' scales (``k_scale``, ``v_scale``, MLA's ``kv_scale``) say what their entries stand for.

    With ``padding_block`` the pools hold one block more, which no sequence is given: padding
    tokens of a compiled step write there (``padding_slot``), as a graph cannot skip them."""

    def __init__(self, model, num_blocks: int, block_size: int, backend, padding_block: bool = False,
                 dtype: torch.dtype | None = None):
        parameter = next(model.parameters())
        self.model = model
        self.backend = backend
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype = dtype or parameter.dtype
        self.padding_slot = num_blocks * block_size if padding_block else None
        self.pools = [self._layer_pools(layer, num_blocks + padding_block, parameter.device)
                      for layer in model.kv_cache_spec()]
        model.bind_kv_cache(backend, self.pools)
        # When the engine goes, its cache goes with it, though the model it ran lives on.
        weakref.finalize(self, model.unbind_kv_cache, self.pools)

    def _layer_pools(self, shapes: tuple[tuple[int, ...], ...], num_blocks: int, device) -> tuple[torch.Tensor, ...]:
        if len(shapes) == 2:  # K and V of plain attention, one shape (kv_cache_spec)
            return new_kv_cache(num_blocks, self.block_size, *shapes[0], self.dtype, device)
        return tuple(torch.empty((num_blocks, self.block_size, *shape), dtype=self.dtype, device=device)
                     for shape in shapes)

    def bound(self) -> bool:
        """Whether the model still attends over these pools (a newer engine of the model binds its own)."""
        return self.model.bound_kv_cache is self.pools
