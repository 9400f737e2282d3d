"""Linear layers, plain and fused from several HuggingFace projections."""

import itertools
import warnings

import torch
from torch import nn

from layers.embedding import LMHead
from layers.norm import LinearRowProduct, NormedRow
from layers.weights import OneOf, Shard, parent_of
from ops_cuda import normed_gemv
from ops_cuda.fp8_linear import fp8_block_linear
from ops_cuda.linear import PackedWeight, linear, takes_gemv


class Linear(nn.Module):
    """y = x W^T + b. Parameters are left uninitialised: a loader always fills them.

    Where an FP8 block-quantised checkpoint is loaded with its weights kept in FP8, the loader
    stores the weight as float8_e4m3fn, its scales in ``weight_scale_inv`` and their block in
    ``fp8_block``, and the product is ``zoo::fp8_block_linear``. ``fp8=False`` keeps the weight in
    the model's dtype whatever the checkpoint: for a weight a layer reads directly, not through
    ``forward`` (MLA's ``kv_b_proj``).

    A layer marked ``into_norm`` (a decoder branch's last product, where the RMSNorm after it is split:
    ``DecoderLayer.splits_norms``) returns a single GPU row's product undone, a ``LinearRowProduct`` that
    the norm computes. Any layer reads a ``NormedRow`` (the output of a split norm).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, fp8: bool = True):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: PackedWeight | None = None  # see pack_cpu_weights
        self.fp8_parameters = ("weight",) if fp8 else ()  # the loader's declaration: see loaders.load
        self.fp8_block: tuple[int, int] | None = None
        self.register_buffer("weight_scale_inv", None)
        self.into_norm = False

    def forward(self, x: torch.Tensor | NormedRow) -> torch.Tensor | LinearRowProduct:
        if isinstance(x, NormedRow):
            if self.fp8_block is None and x.takes(self.weight):
                return normed_gemv(x.weighted, x.stats, x.eps, self.weight, self.bias)
            x = x.normalised()
        if self.into_norm and self.fp8_block is None and takes_gemv(x, self.weight):
            return LinearRowProduct(x, self.weight, self.bias)
        if self.fp8_block is not None:
            return fp8_block_linear(x, self.weight, self.weight_scale_inv, self.fp8_block, self.bias)
        return linear(x, self.weight, self.bias, self.packed)

    def extra_repr(self) -> str:
        fp8 = f", fp8_block={list(self.fp8_block)}" if self.fp8_block is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{fp8}"


class MergedLinear(Linear):
    """Several projections of the same input in one matmul, e.g. q/k/v or gate/up.

    ``sources`` names the HuggingFace sibling modules whose weights (and biases) are stacked
    along the output dimension, in order; ``output_sizes`` gives each one's width. A checkpoint
    may also hold them stacked already, under this module's own name (Phi-3's ``qkv_proj`` and
    ``gate_up_proj``).
    """

    def __init__(self, in_features: int, output_sizes: list[int], sources: list[str], bias: bool = False):
        assert len(output_sizes) == len(sources)
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.sources = list(sources)

    def checkpoint_shards(self, prefix: str) -> dict[str, OneOf]:
        parent = parent_of(prefix)
        layouts = {}
        for name, _ in self.named_parameters(recurse=False):
            starts = itertools.accumulate(self.output_sizes, initial=0)
            apart = [Shard(f"{parent}.{source}.{name}", (slice(start, start + size),))
                     for source, start, size in zip(self.sources, starts, self.output_sizes)]
            layouts[name] = OneOf(apart, [Shard(f"{prefix}.{name}")])
        return layouts

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.output_sizes, dim=-1)


def pack_cpu_weights(model: nn.Module) -> None:
    """Gives each float32 or bfloat16 CPU linear layer and LM head of ``model`` a copy of its weight
    packed by oneDNN (``ops_cuda.linear.PackedWeight``), which its products then read. The runtime
    does this when it runs a model on the CPU. The copies cost the weights' memory once more, so where
    they would take more than half of the memory still available, nothing is packed and a warning
    says so."""
    modules = [m for m in model.modules() if isinstance(m, (Linear, LMHead)) and PackedWeight.supports(m.weight)]
    needed = sum(m.weight.numel() * m.weight.element_size() for m in modules)
    available = available_memory()
    if modules and available is not None and needed > available // 2:
        warnings.warn(
            f"zoo: not packing the weights for the CPU: the packed copies ({needed / 2**30:.1f} GiB) would take more "
            f"than half of the available memory ({available / 2**30:.1f} GiB); the products run on the unpacked "
            "weights, slower", stacklevel=2,
        )
        return
    for module in modules:
        module.packed = PackedWeight(module.weight)


def available_memory() -> int | None:
    """Bytes of memory this process can still get: Linux's MemAvailable, or less where a cgroup
    (a container's memory limit, v2 or v1) leaves less. None where neither is known."""
    limits = []
    try:
        with open("/proc/meminfo") as meminfo:
            limits += [int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:")]
    except OSError:
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as limit, open(usage_file) as usage:
                limit_text = limit.read().strip()
                if limit_text != "max":
                    limits.append(int(limit_text) - int(usage.read()))
        except (OSError, ValueError):
            continue
    return min(limits, default=None)
