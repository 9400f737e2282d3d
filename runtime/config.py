"""``EngineConfig``: every option of the engine, its default and its meaning, checked in one place."""

import dataclasses
import math
from dataclasses import dataclass

from layers.attention import BACKENDS
from runtime.sampling_params import is_finite_number, is_integer

# The KV cache's dtypes: "auto" is the model's, "fp8" float8_e4m3fn (values over per-tensor scales).
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's options. A config is checked when it is made, before any model loads;
    ``resolved`` fills in what depends on the model."""

    max_num_seqs: int = 64  # sequences that run in one step at most
    max_model_len: int | None = None  # prompt + generated tokens of a sequence at most (None: the model's limit)
    block_size: int = 16  # tokens per KV-cache block
    num_blocks: int | None = None  # KV-cache blocks (None: as many as the memory budget holds)
    # The KV cache's memory (None: 1 GiB on the CPU, on CUDA as below): per device on CUDA, on the CPU
    # all tensor-parallel ranks' together (they share the host's memory).
    kv_cache_gib: float | None = None
    gpu_memory_utilization: float = 0.9  # on CUDA, the device's share for the model, its largest step and the cache
    max_num_batched_tokens: int | None = None  # new tokens per step at most (None: as ``resolved`` sets it)
    enable_chunked_prefill: bool = True  # split long prompts over several steps, next to running decodes
    enable_prefix_caching: bool = True  # reuse the KV blocks of a prompt's leading tokens that an earlier one computed
    enforce_eager: bool = False  # on CUDA, run decode steps eagerly instead of replaying CUDA graphs
    compile_decode: bool = False  # on the CPU, run decode steps through one graph torch.compile builds at start
    attention_backend: str | None = None  # "torch" (the reference) or "triton" (None: triton on CUDA, else torch)
    tensor_parallel_size: int = 1  # ranks (processes, one device each) the model is split over (runtime.parallel)
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8" (e4m3: a byte per value, about twice the blocks)

    def __post_init__(self):
        for name in ("max_num_seqs", "max_model_len", "block_size", "num_blocks", "max_num_batched_tokens",
                     "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and not (is_integer(value) and value > 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        # Its bytes, not only the GiB, must be a finite float: the budget is divided into blocks.
        if self.kv_cache_gib is not None and not (is_finite_number(self.kv_cache_gib) and self.kv_cache_gib > 0
                                                  and math.isfinite(self.kv_cache_gib * (1 << 30))):
            raise ValueError(f"kv_cache_gib must be a finite number of GiB > 0, got {self.kv_cache_gib!r}")
        if not (is_finite_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "enforce_eager", "compile_decode"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.compile_decode and self.tensor_parallel_size > 1:
            raise ValueError("compile_decode compiles a model that runs in one process: it does not go with "
                             "tensor_parallel_size > 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
        if self.attention_backend is not None and self.attention_backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {self.attention_backend!r}; choose one of {sorted(BACKENDS)}")

    @classmethod
    def from_options(cls, base: "EngineConfig | None" = None, **options) -> "EngineConfig":
        """``base`` (the defaults when None) with ``options`` changed; an option that does not exist is named."""
        if base is not None and not isinstance(base, cls):
            raise TypeError(f"config must be an EngineConfig (or left out, options given by name), got {base!r}")
        names = [field.name for field in dataclasses.fields(cls)]
        unknown = [name for name in options if name not in names]
        if unknown:
            raise ValueError(f"unknown engine option {unknown[0]!r}; the options are {', '.join(names)}")
        return dataclasses.replace(base or cls(), **options)

    def resolved(self, model_max_len: int) -> "EngineConfig":
        """This config with max_model_len capped by the model's ``model_max_len``, and
        max_num_batched_tokens by default max(2048, max_num_seqs), or max_model_len without
        chunked prefill, where a prompt is computed in one step."""
        max_model_len = model_max_len if self.max_model_len is None else min(self.max_model_len, model_max_len)
        max_tokens = self.max_num_batched_tokens
        if max_tokens is None:
            max_tokens = max(2048, self.max_num_seqs) if self.enable_chunked_prefill else max_model_len
        if not self.enable_chunked_prefill and max_tokens < max_model_len:
            raise ValueError(f"without chunked prefill max_num_batched_tokens ({max_tokens}) "
                             f"must be >= max_model_len ({max_model_len})")
        return dataclasses.replace(self, max_model_len=max_model_len, max_num_batched_tokens=max_tokens)
