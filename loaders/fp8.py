"""FP8 block-quantised safetensors checkpoints, as DeepSeek-V3's ship: a quantised tensor ``T`` is
stored as float8_e4m3fn beside its ``T_scale_inv`` (float32, one scale per ``weight_block_size``
block of its last two dimensions, edge blocks partial), and config.json carries a
``quantization_config`` with ``quant_method: fp8``. Each such pair becomes one lazy float32
``TensorRef`` of the dequantised tensor under ``T``'s name, so the loader and every declared layout
(fused shards, stacked experts) take it like any other tensor; the pair itself rides along in the
reference's ``fp8``, for the loader to keep where the weight stays in FP8 (``loaders.load``)."""

from pathlib import Path

import torch

from loaders.types import FLOAT_DTYPES, CheckpointError, Fp8Blocks, TensorRef, name_list
from ops_cuda.fp8 import block_scale_shape, dequantise

FP8_DTYPE = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"
# The quantization_config fields zoo reads besides quant_method and weight_block_size, with the one
# value each may take; a field left out means that value (as in transformers' FineGrainedFP8Config).
SUPPORTED_FIELDS = {"fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "float", "expert_dtype": "fp8"}


def fp8_block_size(config, config_file: Path) -> tuple[int, int] | None:
    """The ``weight_block_size`` of the config's FP8 ``quantization_config``; None without a
    quantization_config; a CheckpointError naming what zoo takes for any other."""
    quantization = quantization_config(config)
    if quantization is None:
        return None
    supported = (f"zoo takes quant_method 'fp8' with {SUPPORTED_FIELDS} and weight_block_size "
                 f"[rows, columns] of two positive ints, or 'mxfp4' (loaders/mxfp4.py)")
    method = quantization.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"{config_file}: quantization_config quant_method {method!r} is not supported; {supported}")
    for field, value in SUPPORTED_FIELDS.items():
        if quantization.get(field, value) != value:
            raise CheckpointError(
                f"{config_file}: quantization_config {field} {quantization[field]!r} is not supported; {supported}"
            )
    block = quantization.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in block)):
        raise CheckpointError(
            f"{config_file}: quantization_config weight_block_size {block!r} is not supported; {supported}"
        )
    return tuple(block)


def dequantised_fp8(tensors: dict[str, TensorRef], config, config_file: Path) -> dict[str, TensorRef]:
    """``tensors`` with every FP8 tensor and its scale replaced by the dequantised float32 tensor.
    A scale whose tensor is not FP8 stays, for the loader to report as unexpected. Raises for a
    quantization_config zoo does not take (with FP8 tensors or without), and one CheckpointError
    listing every FP8 tensor that cannot be dequantised."""
    block = fp8_block_size(config, config_file)
    quantised = [ref for ref in tensors.values() if ref.dtype == FP8_DTYPE]
    if not quantised:
        return tensors
    if block is None:
        raise CheckpointError(
            f"{config_file} has no quantization_config, but the checkpoint holds {len(quantised)} FP8 "
            f"({FP8_DTYPE}) tensors: {name_list([ref.name for ref in quantised], tensors)}"
        )
    unconverted = list(quantization_config(config).get("modules_to_not_convert") or [])
    problems = []
    result = dict(tensors)
    for ref in quantised:
        scale = tensors.get(ref.name + SCALE_SUFFIX)
        module = ref.name.rpartition(".")[0]
        where = f"tensor {ref.name!r} in {ref.file}"
        if unconverted and not _converted(module, unconverted):
            problems.append(f"{where}: stored in FP8, but quantization_config.modules_to_not_convert "
                            f"{unconverted} names its module {module!r}")
        elif scale is None:
            problems.append(f"{where}: FP8 without its scale {ref.name + SCALE_SUFFIX!r}")
        elif len(ref.shape) < 2:
            problems.append(f"{where}: FP8 with shape {ref.shape}; block scales need at least two dimensions")
        elif scale.dtype not in FLOAT_DTYPES:
            problems.append(f"scale {scale.name!r} in {scale.file}: dtype {scale.dtype} is not a floating-point type")
        elif scale.shape != (expected := block_scale_shape(ref.shape, block)):
            problems.append(f"scale {scale.name!r} in {scale.file}: expected shape {expected} for {ref.name} "
                            f"{ref.shape} in blocks of {list(block)}, got {scale.shape}")
        else:
            del result[scale.name]
            result[ref.name] = TensorRef(ref.name, ref.shape, "F32", ref.file, _reader(ref, scale, block),
                                         ref.nbytes + scale.nbytes, Fp8Blocks(ref, scale, block))
    if problems:
        raise CheckpointError("FP8 checkpoint tensors that cannot be dequantised:\n  " + "\n  ".join(problems))
    return result


def _reader(weight: TensorRef, scale: TensorRef, block: tuple[int, int]):
    def load() -> torch.Tensor:
        return dequantise(weight.load(), scale.load(), block)

    return load


def quantization_config(config) -> dict | None:
    """The config's quantization_config as a dict (transformers keeps it as read from config.json)."""
    quantization = getattr(config, "quantization_config", None)
    return quantization if quantization is None or isinstance(quantization, dict) else quantization.to_dict()


def _converted(module: str, patterns: list[str]) -> bool:
    """transformers' own reading of ``modules_to_not_convert`` (prefix, regex or suffix of a module name)."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    return should_convert_module(module, patterns)
