"""Tiny random llama-architecture GGUF files, written the way llama.cpp's converter writes them.

2D weights are stored in the type under test, norms in F32; q/k rows carry llama.cpp's permutation.
Types gguf-py can quantise go through ``gguf.quants.quantize``; Q4_K and Q6_K (which it cannot
quantise) are random but valid raw blocks with small fp16 scales, so nothing dequantises to inf/nan.
A file can carry a tiny tokenizer of either kind llama.cpp writes: byte-level BPE ("gpt2": Llama 3,
Qwen, SmolLM) or sentencepiece ("llama": Llama 2, Mistral).
"""

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from transformers.convert_slow_tokenizer import bytes_to_unicode

T = GGMLQuantizationType
TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K)

# Rows are multiples of 256 (the K-quant block size) along every stored row.
SHAPE = dict(hidden=256, intermediate=512, layers=2, vocab=512, heads=4, kv_heads=2)
RMS_EPS = 1e-5
ROPE_THETA = 10000.0


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: per head, rows (half, pairs) -> (pairs, half)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(len(values), 2)


def _raw_q4_k(rng, n_blocks: int) -> np.ndarray:
    """Blocks of d (fp16), dmin (fp16), 12 bytes of packed 6-bit scales/mins, 128 bytes of nibbles."""
    d = _f16_bytes(rng.uniform(1e-4, 3e-4, n_blocks))
    dmin = _f16_bytes(rng.uniform(1e-4, 3e-4, n_blocks))
    rest = rng.integers(0, 256, (n_blocks, 12 + QK_K // 2), dtype=np.uint8)
    return np.concatenate([d, dmin, rest], axis=1)


def _raw_q6_k(rng, n_blocks: int) -> np.ndarray:
    """Blocks of 128 bytes low nibbles, 64 bytes high bits, 16 int8 scales, d (fp16)."""
    quants = rng.integers(0, 256, (n_blocks, QK_K // 2 + QK_K // 4), dtype=np.uint8)
    scales = rng.integers(-32, 33, (n_blocks, QK_K // 16), dtype=np.int8).view(np.uint8)
    d = _f16_bytes(rng.uniform(1e-4, 3e-4, n_blocks))
    return np.concatenate([quants, scales, d], axis=1)


_RAW = {T.Q4_K: _raw_q4_k, T.Q6_K: _raw_q6_k}


def stored(rng, rows: int, cols: int, qtype: GGMLQuantizationType) -> np.ndarray:
    """A random [rows, cols] weight in GGUF's stored form: float32/float16, or uint8 bytes per row."""
    if qtype in _RAW:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        return _RAW[qtype](rng, rows * cols // block_size).reshape(rows, cols // block_size * type_size)
    return quantize(rng.normal(0.0, 0.05, (rows, cols)).astype(np.float32), qtype)


CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
# Pairs merged in this order, each of two tokens already in the vocabulary.
PIECES = [("t", "h"), ("th", "e"), ("i", "n"), ("e", "r"), ("o", "n"), ("r", "e"), ("o", "r"), ("l", "d"),
          ("w", "or"), ("wor", "ld"), ("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o")]


def _add_tokenizer(writer: GGUFWriter, kind: str) -> None:
    if kind == "gpt2":  # bytes spelled in GPT-2's alphabet, a word's leading space as "Ġ"
        merges = [(a, b) for a, b in PIECES] + [("Ġ", "the"), ("Ġ", "world")]
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        tokens = list(bytes_to_unicode().values()) + [a + b for a, b in merges] + specials
        types = [TokenType.NORMAL] * (len(tokens) - len(specials)) + [TokenType.CONTROL] * len(specials)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_merges([f"{a} {b}" for a, b in merges])
        bos, eos, add_bos = tokens.index("<|im_start|>"), tokens.index("<|im_end|>"), False
    else:  # sentencepiece: unk, bos, eos, 256 byte fallbacks, then pieces scored best-first
        pieces = ["▁"] + [a + b for a, b in PIECES] + ["▁the", "▁world", "▁hello"]
        pieces += sorted({c for piece in pieces for c in piece} - set(pieces))
        tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
        types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
        types += [TokenType.NORMAL] * len(pieces)
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
        writer.add_unk_token_id(0)
        bos, eos, add_bos = 1, 2, True
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)


def _add(writer: GGUFWriter, name: str, data: np.ndarray, qtype: GGMLQuantizationType) -> None:
    if data.dtype == np.uint8:  # the byte shape: add_tensor derives the element shape from it
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    else:
        writer.add_tensor(name, data)


def write_llama_gguf(
    path: Path, qtype: GGMLQuantizationType, *, arch: str = "llama", tied: bool = False, seed: int = 0,
    tokenizer: str | None = None, shape: dict = SHAPE,
) -> dict:
    """Write the file; return its 2D weights in stored form before the q/k permutation, by GGUF name.

    ``tokenizer``: "gpt2" or "llama" adds a tokenizer of that kind to the metadata.

    ``tied``: no output.weight, which is how llama.cpp stores tied embeddings. q/k rows are permuted
    after quantising where the converter permutes before: the same bytes, since quantisation
    blocks run along a row and the permutation only moves whole rows."""
    s, rng = shape, np.random.default_rng(seed)
    head_dim = s["hidden"] // s["heads"]
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama")
    writer.add_context_length(128)
    writer.add_block_count(s["layers"])
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_vocab_size(s["vocab"])
    if tokenizer is not None:
        _add_tokenizer(writer, tokenizer)

    kv = s["kv_heads"] * head_dim
    shapes = {"token_embd.weight": (s["vocab"], s["hidden"])}
    for i in range(s["layers"]):
        shapes |= {
            f"blk.{i}.attn_q.weight": (s["hidden"], s["hidden"]),
            f"blk.{i}.attn_k.weight": (kv, s["hidden"]),
            f"blk.{i}.attn_v.weight": (kv, s["hidden"]),
            f"blk.{i}.attn_output.weight": (s["hidden"], s["hidden"]),
            f"blk.{i}.ffn_gate.weight": (s["intermediate"], s["hidden"]),
            f"blk.{i}.ffn_up.weight": (s["intermediate"], s["hidden"]),
            f"blk.{i}.ffn_down.weight": (s["hidden"], s["intermediate"]),
        }
    if not tied:
        shapes["output.weight"] = (s["vocab"], s["hidden"])

    weights = {name: stored(rng, *shape, qtype) for name, shape in shapes.items()}
    for name, data in weights.items():
        if ".attn_q." in name:
            data = llama_cpp_permute(data, s["heads"], s["heads"])
        elif ".attn_k." in name:
            data = llama_cpp_permute(data, s["heads"], s["kv_heads"])
        _add(writer, name, data, qtype)
    for i in range(s["layers"]):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.5, 1.5, s["hidden"]).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, s["hidden"]).astype(np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights
