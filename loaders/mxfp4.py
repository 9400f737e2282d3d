"""MXFP4 safetensors checkpoints, as gpt-oss ships its experts: a quantised tensor ``T`` is stored as
``T_blocks`` (uint8 [..., rows, groups, 16], two 4-bit e2m1 values a byte, the low nibble first: 32
values a group) beside ``T_scales`` (uint8 [..., rows, groups], each group's power-of-two scale as an
e8m0 exponent, biased by 127), and config.json carries a ``quantization_config`` with ``quant_method:
mxfp4``. Each pair becomes one lazy ``TensorRef`` named ``T`` of the dequantised tensor as transformers
dequantises it into its model: in bfloat16, which holds every such value exactly, with its last two
dimensions swapped ([..., columns, rows], the input-by-output layout of GPT-OSS's expert parameters).
The loader reads it through the declarations of those parameters like any other tensor; the pair rides
along in the reference's ``mxfp4``, for the loader to keep where the experts stay in MXFP4
(``loaders.load``)."""

from pathlib import Path

import torch

from loaders.fp8 import quantization_config
from loaders.types import CheckpointError, Mxfp4Blocks, TensorRef, name_list
from ops_cuda.mxfp4 import GROUP_BYTES, dequantise_mxfp4

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def is_mxfp4(config) -> bool:
    quantization = quantization_config(config)
    return quantization is not None and quantization.get("quant_method") == "mxfp4"


def dequantised_mxfp4(tensors: dict[str, TensorRef], config_file: Path) -> dict[str, TensorRef]:
    """``tensors`` with every ``T_blocks``/``T_scales`` pair replaced by the dequantised ``T`` (transposed:
    the module docstring). Raises one CheckpointError listing every pair that cannot be read."""
    problems = []
    result = dict(tensors)
    for blocks in [ref for name, ref in tensors.items() if name.endswith(BLOCKS_SUFFIX)]:
        name = blocks.name.removesuffix(BLOCKS_SUFFIX)
        scales = tensors.get(name + SCALES_SUFFIX)
        where = f"tensor {blocks.name!r} in {blocks.file}"
        if scales is None:
            problems.append(f"{where}: MXFP4 blocks without their scales {name + SCALES_SUFFIX!r}")
        elif blocks.dtype != "U8" or scales.dtype != "U8":
            problems.append(f"{where}: MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
        elif len(blocks.shape) < 3 or blocks.shape[-1] != GROUP_BYTES or blocks.shape[:-1] != scales.shape:
            problems.append(f"{where}: MXFP4 blocks of shape {blocks.shape} with scales of shape {scales.shape}; "
                            f"expected [..., rows, groups, {GROUP_BYTES}] and [..., rows, groups]")
        else:
            *outer, rows, groups, _ = blocks.shape
            del result[blocks.name], result[scales.name]
            result[name] = TensorRef(name, (*outer, groups * 2 * GROUP_BYTES, rows), "BF16", blocks.file,
                                     _reader(blocks, scales), blocks.nbytes + scales.nbytes,
                                     mxfp4=Mxfp4Blocks(blocks, scales))
    orphans = [name for name in tensors if name.endswith(SCALES_SUFFIX) and
               name.removesuffix(SCALES_SUFFIX) + BLOCKS_SUFFIX not in tensors]
    if orphans:
        problems.append(f"MXFP4 scales without their blocks: {name_list(orphans, tensors)}")
    if problems:
        raise CheckpointError(f"MXFP4 checkpoint tensors that cannot be dequantised ({config_file} names "
                              "quant_method mxfp4):\n  " + "\n  ".join(problems))
    return result


def _reader(blocks: TensorRef, scales: TensorRef):
    def load() -> torch.Tensor:
        return dequantise_mxfp4(blocks.load().flatten(-2), scales.load()).mT  # a view: the loader's transposed read copies

    return load
