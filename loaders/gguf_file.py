"""GGUF files (llama.cpp): tensors renamed to HuggingFace's names and dequantised to float32.

The config comes from the GGUF metadata through transformers (see ``loaders.config``); here
only the tensors are read. llama.cpp's converter permutes the rows of Llama's q/k projections
for its interleaved rotary layout; ``unpermute`` restores HuggingFace's rotate-half layout.
"""

import re
from pathlib import Path

import numpy as np
import torch

from loaders.checkpoint import CheckpointError, TensorRef

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


def unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows (pairs, half) -> (half, pairs)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_architecture(reader) -> str:
    field = reader.fields.get("general.architecture")
    return bytes(field.parts[-1]).decode() if field is not None else "<missing>"


def open_reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as exc:  # the reader raises bare ValueErrors/struct errors on damage
        raise CheckpointError(f"{path}: not a readable GGUF file ({exc})") from exc


def gguf_tensors(path: Path, config) -> dict[str, TensorRef]:
    reader = open_reader(path)
    architecture = gguf_architecture(reader)
    if architecture not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {architecture!r} is not supported; supported: {list(ARCHITECTURES)}")
    permuted_heads = {}
    if architecture == "llama":
        heads = config.num_attention_heads
        permuted_heads = {"self_attn.q_proj.weight": heads, "self_attn.k_proj.weight": config.num_key_value_heads or heads}

    tensors: dict[str, TensorRef] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        heads = next((h for suffix, h in permuted_heads.items() if name.endswith(suffix)), None)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        tensors[name] = TensorRef(
            name, shape, "F32", path, _reader(tensor, shape, heads, path), int(np.prod(shape)) * 4
        )
    return tensors


def _reader(tensor, shape, heads, path):
    def load() -> torch.Tensor:
        from gguf.quants import dequantize

        try:
            weight = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        except NotImplementedError as exc:
            raise CheckpointError(
                f"{path}: tensor {tensor.name!r} has GGML type {tensor.tensor_type.name}, which cannot be dequantised"
            ) from exc
        if heads is not None:
            weight = unpermute(weight, heads)
        return torch.from_numpy(np.require(weight, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))

    return load
