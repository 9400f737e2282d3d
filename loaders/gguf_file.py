"""GGUF files (llama.cpp): tensors renamed to HuggingFace's names and dequantised to float32.

This module reads the header itself (``read_gguf``): the metadata's scalars and strings, and
where each tensor lies. The config is built from that metadata with transformers' own key
mapping (``config_dict``, used by ``loaders.config``). llama.cpp's converter permutes the rows
of Llama's q/k projections for its interleaved rotary layout; ``unpermute`` restores
HuggingFace's rotate-half layout.
"""

import functools
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from loaders.types import CheckpointError, TensorRef

ARCHITECTURES = ("llama", "qwen2", "qwen3")

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp's precomputed llama3 rope factors: zoo derives them from the config.
_IGNORED = {"rope_freqs.weight"}

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_TENSOR = re.compile(r"^(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """HuggingFace's name of a GGUF tensor (None: ignored); unknown names come back unchanged,
    so the strict loader reports them as unexpected."""
    if gguf_name in _IGNORED:
        return None
    if (m := _LAYER_TENSOR.match(gguf_name)) and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    if (m := _GLOBAL_TENSOR.match(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return gguf_name


def unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows (pairs, half) -> (half, pairs)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# llama.cpp's first block types: a float16 scale d (and for Q4_1 a float16 minimum m) before each
# block's 32 values, 4-bit ones as 16 bytes whose low nibbles are the first half. Dequantised here
# with torch ops on all cores, the values gguf's numpy gives bit for bit, several times faster
# (SmolLM2's 210 Q4_1 tensors: 0.22 s against 0.85). Other types go through gguf.
_TORCH_BLOCK_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)


@functools.cache
def dequantisable(ggml_type: GGMLQuantizationType) -> bool:
    """Whether ``dequantize_tensor`` takes the type: the installed gguf's dequantisation, tried on
    one block of zeros, covers every float and block type but a few (integer tensors among them)."""
    try:
        dequantize_tensor(np.zeros((1, GGML_QUANT_SIZES[ggml_type][1]), np.uint8), ggml_type)
    except NotImplementedError:
        return False
    return True


def dequantize_tensor(data: np.ndarray, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """The float32 values of ``data``, a GGUF tensor's stored rows (``GGUFTensor.data``), flat."""
    if ggml_type == GGMLQuantizationType.F64:  # a float type gguf's dequantisation leaves out
        return torch.from_numpy(np.array(data).view(np.float64)).float().reshape(-1)
    if ggml_type not in _TORCH_BLOCK_TYPES:
        values = dequantize(data, ggml_type).reshape(-1)  # F32's is a view of the read-only file
        return torch.from_numpy(np.require(values, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))
    blocks = torch.from_numpy(np.array(data)).view(-1, GGML_QUANT_SIZES[ggml_type][1])  # a copy: data is read-only
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    if ggml_type == GGMLQuantizationType.Q8_0:
        return (blocks[:, 2:].contiguous().view(torch.int8).float() * d).reshape(-1)
    packed = blocks[:, 4:] if ggml_type == GGMLQuantizationType.Q4_1 else blocks[:, 2:]
    nibbles = torch.cat([packed & 0x0F, packed >> 4], dim=1)
    if ggml_type == GGMLQuantizationType.Q4_0:
        return (d * (nibbles.float() - 8)).reshape(-1)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return (d * nibbles.float() + m).reshape(-1)


# The header is read here rather than with gguf-py's GGUFReader, which builds a numpy view for
# every element of the metadata arrays (a tokenizer's 49k tokens and merges take seconds).
_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # version 1 had 32-bit counts and lengths
_MAX_DIMS = 4  # GGML_MAX_DIMS
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SCALARS = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: _U32,
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: _U64,
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor of a GGUF file. ``data`` is its stored bytes, a read-only view into the mapped file
    shaped [*shape[:-1], bytes per row], the form ``gguf.quants.dequantize`` takes."""

    name: str
    shape: tuple[int, ...]  # numpy's order, slowest-varying dimension first
    ggml_type: GGMLQuantizationType
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    architecture: str  # "<missing>" when the metadata has no general.architecture
    tensors: list[GGUFTensor]
    metadata: dict[str, object]  # the scalar and string values, by key
    array_lengths: dict[str, int]  # the arrays' lengths, by key (their elements are not read)


class _Header:
    """A cursor over the little-endian header at the start of the mapped file."""

    def __init__(self, path: Path, buffer: memoryview):
        self.path, self.buffer, self.offset = path, buffer, 0

    def take(self, size: int) -> int:
        """Step over ``size`` bytes; return where they start."""
        start, self.offset = self.offset, self.offset + size
        if self.offset > len(self.buffer):
            raise CheckpointError(
                f"{self.path}: truncated GGUF file: its header runs past the end of the file "
                f"({size} bytes at byte {start} of {len(self.buffer)})"
            )
        return start

    def read(self, scalar: struct.Struct):
        return scalar.unpack_from(self.buffer, self.take(scalar.size))[0]

    def raw(self, size: int) -> bytes:
        start = self.take(size)
        return bytes(self.buffer[start : self.offset])

    def raw_string(self) -> bytes:
        return self.raw(self.read(_U64))

    def string(self) -> str:
        raw = self.raw_string()
        try:
            return raw.decode()
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{self.path}: damaged GGUF header: the string {raw[:40]!r} is not UTF-8") from exc

    def skip_value(self, value_type: int) -> None:
        if value_type in _SCALARS:
            self.take(_SCALARS[value_type].size)
        elif value_type == GGUFValueType.STRING:
            self.take(self.read(_U64))
        elif value_type == GGUFValueType.ARRAY:
            item_type = self.read(_U32)
            self.skip_items(item_type, self.read(_U64))
        else:
            raise CheckpointError(f"{self.path}: damaged GGUF header: unknown metadata value type {value_type}")

    def skip_items(self, item_type: int, count: int) -> None:
        """Step over the ``count`` elements of an array."""
        if item_type in _SCALARS:
            self.take(count * _SCALARS[item_type].size)
        elif item_type == GGUFValueType.STRING:
            self._skip_strings(count)
        else:
            for _ in range(count):
                self.skip_value(item_type)

    def _skip_strings(self, count: int) -> None:
        # a tight loop: a tokenizer's vocabulary and merges are tens of thousands of strings each
        buffer, offset, unpack_length = self.buffer, self.offset, _U64.unpack_from
        try:
            for _ in range(count):
                offset += _U64.size + unpack_length(buffer, offset)[0]
        except (struct.error, OverflowError):  # a length to read past the end of the file (or of any offset)
            offset = len(buffer) + 1
        self.take(offset - self.offset)  # reports strings that run past the end


def read_gguf(path: Path) -> GGUFFile:
    """The architecture and tensors of a GGUF file; a damaged file is a CheckpointError naming it."""
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except ValueError as exc:  # numpy cannot map an empty file
        raise CheckpointError(f"{path}: not a readable GGUF file ({exc})") from exc
    header = _Header(path, memoryview(data))
    magic = header.raw(len(_MAGIC))
    if magic != _MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (its magic is {magic!r}, not {_MAGIC!r})")
    version = header.read(_U32)
    if version not in _VERSIONS:
        if int.from_bytes(version.to_bytes(4, "little"), "big") in _VERSIONS:
            raise CheckpointError(f"{path}: big-endian GGUF files are not supported")
        raise CheckpointError(f"{path}: GGUF version {version} is not supported (zoo reads versions 2 and 3)")
    tensor_count, kv_count = header.read(_U64), header.read(_U64)

    metadata, array_lengths = {}, {}
    for _ in range(kv_count):
        key = header.string()
        value_type = header.read(_U32)
        if key == "general.alignment" and value_type != GGUFValueType.UINT32:
            raise CheckpointError(f"{path}: general.alignment has value type {value_type}, not UINT32")
        if value_type in _SCALARS:
            metadata[key] = header.read(_SCALARS[value_type])
        elif value_type == GGUFValueType.STRING:
            metadata[key] = header.string()
        elif value_type == GGUFValueType.ARRAY:
            item_type, array_lengths[key] = header.read(_U32), header.read(_U64)
            header.skip_items(item_type, array_lengths[key])
        else:
            raise CheckpointError(f"{path}: damaged GGUF header: unknown metadata value type {value_type}")
    architecture = metadata.get("general.architecture")
    architecture = architecture if isinstance(architecture, str) else "<missing>"
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if alignment == 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{path}: general.alignment {alignment} is not a power of two")

    infos = []
    for _ in range(tensor_count):
        name = header.string()
        n_dims = header.read(_U32)
        if not 1 <= n_dims <= _MAX_DIMS:
            raise CheckpointError(f"{path}: tensor {name!r} has {n_dims} dimensions")
        dims = struct.unpack_from(f"<{n_dims}Q", header.buffer, header.take(n_dims * _U64.size))
        if not all(dims) or math.prod(dims) >= 2**63:  # the element count is an int64 in llama.cpp
            raise CheckpointError(f"{path}: tensor {name!r} has dimensions {list(dims)}: each must be positive "
                                  f"and their product below 2**63")
        raw_type = header.read(_U32)
        if raw_type not in GGML_QUANT_SIZES:
            raise CheckpointError(f"{path}: tensor {name!r} has unknown GGML type {raw_type}")
        infos.append((name, tuple(reversed(dims)), GGMLQuantizationType(raw_type), header.read(_U64)))

    data_start = header.offset + -header.offset % alignment  # the next multiple of alignment
    # The data section as llama.cpp lays it out and reads it: each tensor right after the one before
    # it, padded to the alignment. A tensor anywhere else (overlapping another, or read with another
    # type's size) is a damaged header.
    tensors, names, expected = [], set(), 0
    for name, shape, ggml_type, offset in infos:
        if name in names:
            raise CheckpointError(f"{path}: tensor {name!r} appears twice")
        names.add(name)
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        if shape[-1] % block_size:
            raise CheckpointError(
                f"{path}: tensor {name!r} has rows of {shape[-1]} elements, not whole {ggml_type.name} blocks of {block_size}"
            )
        if offset != expected:
            raise CheckpointError(f"{path}: damaged GGUF header: tensor {name!r} has offset {offset}, expected {expected} "
                                  f"(right after the tensor before it, padded to {alignment} bytes)")
        row_bytes = shape[-1] // block_size * type_size
        nbytes = math.prod(shape[:-1]) * row_bytes
        start, end = data_start + offset, data_start + offset + nbytes
        if end > len(data):
            raise CheckpointError(
                f"{path}: truncated GGUF file: tensor {name!r} ends at byte {end}, past the end of the file ({len(data)} bytes)"
            )
        tensors.append(GGUFTensor(name, shape, ggml_type, data[start:end].reshape(*shape[:-1], row_bytes)))
        expected = offset + nbytes + -nbytes % alignment
    if infos and len(data) > data_start + expected:
        raise CheckpointError(f"{path}: damaged GGUF header: its tensors end at byte {data_start + expected}, "
                              f"but the file has {len(data)} bytes")
    return GGUFFile(architecture, tensors, metadata, array_lengths)


def config_dict(gguf: GGUFFile) -> dict | None:
    """What transformers' ``load_gguf_checkpoint`` makes of the file's config: its key mapping
    and defaults (``transformers.integrations.ggml``) applied to this module's header reading.
    Its own reading goes through gguf-py's reader (seconds for a tokenizer's vocabulary). None
    when the file needs more than the mapping: an array among the config's keys."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    architecture = gguf.architecture
    # llama.cpp files Mistral under llama; transformers tells them apart by the model's name.
    renamed = "mistral" if architecture == "llama" and gguf.metadata.get("general.name") == "mistral" else architecture

    def config_key(key: str):
        prefix, _, rest = key.replace(architecture, renamed).partition(".")
        name = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        return None if name == -1 else name

    if any(config_key(key) is not None for key in gguf.array_lengths):
        return None
    config = {"tie_word_embeddings": all(tensor.name != "output.weight" for tensor in gguf.tensors)}
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(renamed, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {})
    for key, value in defaults.items():
        config.setdefault(key, value)
    for key, value in gguf.metadata.items():
        if (name := config_key(key)) is not None:
            config[name] = value.replace(architecture, renamed) if isinstance(value, str) else value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in gguf.array_lengths:
        config["vocab_size"] = gguf.array_lengths["tokenizer.ggml.tokens"]
    return config


def gguf_tensors(path: Path, config) -> dict[str, TensorRef]:
    gguf_file = read_gguf(path)
    architecture = gguf_file.architecture
    if architecture not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {architecture!r} is not supported; supported: {list(ARCHITECTURES)}")
    permuted_heads = {}
    if architecture == "llama":
        heads = config.num_attention_heads
        permuted_heads = {"self_attn.q_proj.weight": heads, "self_attn.k_proj.weight": config.num_key_value_heads or heads}

    tensors: dict[str, TensorRef] = {}
    for tensor in gguf_file.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        if not dequantisable(tensor.ggml_type):  # refused before the model is built, not while it loads
            raise CheckpointError(
                f"{path}: tensor {tensor.name!r} has GGML type {tensor.ggml_type.name}, which cannot be dequantised"
            )
        heads = next((h for suffix, h in permuted_heads.items() if name.endswith(suffix)), None)
        tensors[name] = TensorRef(
            name, tensor.shape, "F32", path, _reader(tensor, heads, path), math.prod(tensor.shape) * 4
        )
    return tensors


def _reader(tensor: GGUFTensor, heads, path):
    def load() -> torch.Tensor:
        weight = dequantize_tensor(tensor.data, tensor.ggml_type).reshape(tensor.shape)
        return weight if heads is None else unpermute(weight, heads)

    return load
