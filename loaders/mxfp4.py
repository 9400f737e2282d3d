"""MXFP4 safetensors checkpoints, as gpt-oss ships its experts: a quantised tensor ``T`` is stored as
``T_blocks`` (uint8 [..., rows, groups, 16], two 4-bit e2m1 values a byte, the low nibble first: 32
values a group) beside ``T_scales`` (uint8 [..., rows, groups], each group's power-of-two scale as an
e8m0 exponent, biased by 127), and config.json carries a ``quantization_config`` with ``quant_method:
mxfp4``. Each pair becomes one lazy ``TensorRef`` named ``T`` of the dequantised tensor as transformers
dequantises it into its model: in bfloat16, which holds every such value exactly, with its last two
dimensions swapped ([..., columns, rows], the input-by-output layout of GPT-OSS's expert parameters).
The loader reads it through the declarations of those parameters like any other tensor."""

from pathlib import Path

import torch

from loaders.fp8 import quantization_config
from loaders.types import CheckpointError, TensorRef, name_list

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
# The e2m1 value of each 4-bit code: sign bit, two exponent bits, one mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
GROUP_BYTES = 16  # 32 values a scale
CHUNK_GROUPS = 1 << 20


def dequantise_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 blocks [..., rows, groups, 16] and scales [..., rows, groups] -> bfloat16 [..., rows, groups * 32]."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    out = torch.empty(*blocks.shape[:-1], 2 * GROUP_BYTES, dtype=torch.bfloat16)
    flat_blocks, flat_scales = blocks.reshape(-1, GROUP_BYTES), scales.reshape(-1, 1)
    flat_out = out.view(-1, 2 * GROUP_BYTES)
    for start in range(0, flat_blocks.shape[0], CHUNK_GROUPS):  # the codes of a whole tensor would take gigabytes
        part, rows = flat_blocks[start : start + CHUNK_GROUPS], slice(start, start + CHUNK_GROUPS)
        factors = torch.exp2(flat_scales[rows].to(torch.float32) - SCALE_BIAS)
        flat_out[rows, 0::2] = values[(part & 0x0F).int()] * factors  # the low nibble is the earlier value
        flat_out[rows, 1::2] = values[(part >> 4).int()] * factors
    return out.flatten(-2)


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
                                     _reader(blocks, scales), blocks.nbytes + scales.nbytes)
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
        return dequantise_mxfp4(blocks.load(), scales.load()).mT  # a view: the loader's transposed read copies

    return load
