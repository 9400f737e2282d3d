"""GGUF loading against HuggingFace, one tiny random llama file per GGML tensor type.

Each file is written like llama.cpp's converter writes it (tests/gguf_writer.py): q/k rows permuted,
2D weights in the type under test, norms in F32, GQA (4 heads, 2 kv heads)."""

import numpy as np
import pytest
import torch
import transformers
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf.quants import dequantize

from loaders import CheckpointError, load_config, load_tokenizer, resolve_source
from loaders.config import _gguf_tokenizer_class
from loaders.gguf_file import dequantize_tensor, gguf_tensors, read_gguf
from loaders.load import choose_layouts, declared_layouts
from models import AutoModelForCausalLM, UnsupportedArchitectureError
from tests.conftest import relative_error, tiny_config
from tests.loaders.gguf_writer import SHAPE, TYPES, T, llama_cpp_permute, write_llama_gguf

RTOL = 1e-5


def load_both(path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return hf.eval(), AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


@pytest.fixture(scope="module", params=TYPES, ids=lambda t: t.name)
def case(request, tmp_path_factory):
    """(type, path, stored weights before the q/k permutation, HF model, zoo model), once per type."""
    qtype = request.param
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{qtype.name}.gguf"
    weights = write_llama_gguf(path, qtype)
    return qtype, path, weights, *load_both(path)


def zoo_weight(model, name: str) -> torch.Tensor:
    """The slice of zoo's (possibly fused) parameter that the checkpoint tensor ``name`` fills."""
    [(param, index, _, _)] = choose_layouts(declared_layouts(model), {})[0][name]
    return model.get_parameter(param)[index]


def prompt_ids():
    return torch.randint(0, SHAPE["vocab"], (2, 16), generator=torch.Generator().manual_seed(0))


def assert_logits_match(hf, zoo):
    ids = prompt_ids()
    with torch.no_grad():
        expected, actual = hf(ids).logits, zoo(ids)
    assert actual.shape == expected.shape == (2, 16, SHAPE["vocab"])
    assert torch.isfinite(expected).all() and expected.abs().max() > 0.1  # a real signal, not all zeros
    rel = relative_error(actual, expected)
    assert rel <= RTOL, f"relative logit error {rel:.3g}"
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


def test_config_from_metadata(case):
    _, path, *_ = case
    config = load_config(resolve_source(path))
    assert config.model_type == "llama"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size) == (256, 512, 2, 512)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 64)
    assert config.tie_word_embeddings is False


def test_logits_match_hf(case):
    *_, hf, zoo = case
    assert_logits_match(hf, zoo)


def test_dtype_auto_is_float32(case):
    _, path, *_ = case
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("proj, tensor", [("q_proj", "attn_q"), ("k_proj", "attn_k")])
def test_qk_dequantised_and_unpermuted(case, proj, tensor):
    """zoo's q/k weights are the stored rows dequantised with gguf-py and put back in HF's order:
    bit-equal to the weight before llama.cpp's permutation, and to HF's loaded weight."""
    qtype, path, weights, hf, zoo = case
    heads = SHAPE["heads"] if proj == "q_proj" else SHAPE["kv_heads"]
    in_file = {t.name: t for t in GGUFReader(str(path)).tensors}
    for i in range(SHAPE["layers"]):
        name = f"blk.{i}.{tensor}.weight"
        assert in_file[name].tensor_type == qtype
        stored = dequantize(in_file[name].data, qtype)
        expected = dequantize(weights[name], qtype)
        # the file holds llama.cpp's row order, and the permutation really moves rows
        np.testing.assert_array_equal(stored, llama_cpp_permute(expected, SHAPE["heads"], heads))
        assert not np.array_equal(stored, expected)

        hf_name = f"model.layers.{i}.self_attn.{proj}.weight"
        actual = zoo_weight(zoo, hf_name)
        assert actual.dtype == torch.float32 and torch.isfinite(actual).all()
        assert torch.equal(actual, torch.from_numpy(expected))
        assert torch.equal(actual, hf.get_parameter(hf_name))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_torch_dequantisation_gives_gguf_py_values_bit_for_bit(qtype):
    """Random blocks (every nibble and int8 value, float16 scales and minimums of both signs and
    many magnitudes, subnormal ones among them), 40 rows of 3 blocks."""
    rng = np.random.default_rng(0)
    type_size = GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (40 * 3, type_size), dtype=np.uint8)
    halves = 2 if qtype == T.Q4_1 else 1  # d, and Q4_1's m
    scales = rng.normal(size=(40 * 3, halves)) * 10.0 ** rng.integers(-7, 2, (40 * 3, halves))
    blocks[:, : 2 * halves] = scales.astype(np.float16).view(np.uint8)
    rows = blocks.reshape(40, 3 * type_size)
    ours = dequantize_tensor(rows, qtype)
    assert ours.dtype == torch.float32 and ours.shape == (40 * 3 * 32,)
    assert torch.equal(ours, torch.from_numpy(dequantize(rows, qtype).reshape(-1)))


def test_float64_tensors_dequantise_to_their_float32_values():
    values = np.random.default_rng(0).normal(size=(3, 5))
    ours = dequantize_tensor(values.view(np.uint8), T.F64)
    assert ours.dtype == torch.float32 and torch.equal(ours, torch.from_numpy(values.astype(np.float32)).reshape(-1))


def test_a_tensor_of_a_type_that_does_not_dequantise_is_refused_before_the_model_is_built(good_file, tmp_path,
                                                                                          monkeypatch):
    import models.auto

    path = tmp_path / "int.gguf"
    path.write_bytes(good_file.read_bytes())
    reader = GGUFReader(path, "r+")
    [norm] = [t for t in reader.tensors if t.name == "output_norm.weight"]
    assert norm.tensor_type == T.F32
    norm.field.parts[4][:] = int(T.I32)  # the tensor info's type: the same 4 bytes an element
    reader.data.flush()
    del reader

    def no_building(*args, **kwargs):
        raise AssertionError("the model was built before its tensors' types were checked")

    monkeypatch.setattr(models.auto, "_build_on_meta", no_building)
    with pytest.raises(CheckpointError, match=r"int.gguf: tensor 'output_norm.weight' has GGML type I32, "
                                              r"which cannot be dequantised"):
        AutoModelForCausalLM.from_pretrained(path)


def test_reader_matches_gguf_py(case):
    """zoo's header reader finds the same tensors as gguf-py's GGUFReader, down to the stored bytes."""
    _, path, *_ = case
    expected, actual = GGUFReader(str(path)).tensors, read_gguf(path).tensors
    assert [t.name for t in actual] == [t.name for t in expected]
    for ours, theirs in zip(actual, expected):
        assert ours.shape == tuple(reversed(theirs.shape.tolist()))
        assert ours.ggml_type == theirs.tensor_type
        assert ours.data.tobytes() == theirs.data.tobytes()


@pytest.mark.parametrize("arch, tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_config_equals_transformers(tmp_path, arch, tied):
    """zoo builds a GGUF's config from the header it reads itself (``config_dict``): the same
    config transformers builds from its own reading of the whole file."""
    path = tmp_path / f"{arch}.gguf"
    write_llama_gguf(path, T.F32, arch=arch, tied=tied)
    theirs = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    assert load_config(resolve_source(path)).to_dict() == theirs.to_dict()


TOKENIZER_TEXTS = ["hello the world, the other world!", "  two leading spaces\tand a tab\n", "Ça va? 你好 1234",
                   "<|im_start|>user\nhi<|im_end|>", "<s>hello</s>"]


def assert_same_tokenizer(ours, theirs):
    assert type(ours) is type(theirs)
    for text in TOKENIZER_TEXTS:
        ids = theirs(text).input_ids
        assert ours(text).input_ids == ids
        assert ours.decode(ids) == theirs.decode(ids)
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.chat_template == theirs.chat_template


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tokenizer_equals_autotokenizer(tmp_path, arch, kind):
    """zoo picks AutoTokenizer's class from its own config of the file (no second full read of the
    file); the tokenizer is the same, byte-level BPE or sentencepiece, for each architecture."""
    path = tmp_path / f"{arch}.gguf"
    write_llama_gguf(path, T.F32, arch=arch, tokenizer=kind)
    assert _gguf_tokenizer_class(resolve_source(path)) is not None  # the fast path is the one tested
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert_same_tokenizer(load_tokenizer(str(path)), theirs)


def test_tokenizer_config_beside_the_file_goes_to_autotokenizer(tmp_path):
    path = tmp_path / "llama.gguf"
    write_llama_gguf(path, T.F32, tokenizer="gpt2")
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
    assert _gguf_tokenizer_class(resolve_source(path)) is None
    assert type(load_tokenizer(str(path))).__name__ == "GPT2Tokenizer"


def test_file_without_tokenizer_has_none(tmp_path):
    path = tmp_path / "llama.gguf"
    write_llama_gguf(path, T.F32)
    assert load_tokenizer(str(path)) is None


@pytest.mark.parametrize("damage, cause", [
    ((b"wor ld", b"wor zz"), r"Exception: Error while initializing BPE: Token `zz` out of vocabulary"),
    ((b"hell", b"\xffell"), r"UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff"),
    ((b"gpt2", b"gpt9"), r"Cannot build a tokenizer from a GGUF file stating tokenizer 'gpt9'"),
], ids=["merge", "non-utf8-token", "model"])
def test_a_damaged_vocabulary_is_an_error_naming_the_file(tmp_path, damage, cause):
    path = tmp_path / "llama.gguf"
    write_llama_gguf(path, T.F32, tokenizer="gpt2")
    data = path.read_bytes()
    assert damage[0] in data
    path.write_bytes(data.replace(*damage, 1))
    with pytest.raises(CheckpointError, match=r"llama\.gguf \(its tokenizer\.ggml metadata\): the checkpoint's "
                                              r"tokenizer cannot be built \(.*" + cause):
        load_tokenizer(str(path))


def test_a_damaged_tokenizer_file_is_an_error_naming_it(make_checkpoint):
    path, _ = make_checkpoint(tiny_config("llama"))
    (path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}}')
    with pytest.raises(CheckpointError, match=r"ckpt/tokenizer\.json: the checkpoint's tokenizer cannot be built"):
        load_tokenizer(str(path))


def test_tied_embeddings(tmp_path):
    """No output.weight (how llama.cpp stores tied embeddings): lm_head shares embed_tokens."""
    path = tmp_path / "tied.gguf"
    write_llama_gguf(path, T.Q6_K, tied=True)
    hf, zoo = load_both(path)
    assert hf.config.tie_word_embeddings is True
    assert zoo.lm_head.weight is zoo.model.embed_tokens.weight
    assert_logits_match(hf, zoo)


# --- damaged and unsupported files -----------------------------------------------------------


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "good.gguf"
    write_llama_gguf(path, T.Q8_0)
    return path


def test_truncated_file(good_file, tmp_path):
    """The header survives the cut, the tensor data does not: zoo's reader, which reads the
    header for the config, reports the first tensor that runs past the end."""
    path = tmp_path / "truncated.gguf"
    data = good_file.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"truncated GGUF file: tensor '[\w.]+' ends at byte \d+, past the end") as err:
        AutoModelForCausalLM.from_pretrained(str(path))
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    "cut, message",
    [
        ("metadata", "its header runs past the end of the file"),
        ("tensor infos", "its header runs past the end of the file"),
        ("tensor data", "tensor '.*' ends at byte"),
    ],
)
def test_truncated_file_in_zoo_reader(good_file, tmp_path, cut, message):
    """zoo's own reader, given a file cut anywhere, reports the cut against the file."""
    data = good_file.read_bytes()
    end = {
        "metadata": 64,
        "tensor infos": data.index(b"output_norm.weight") + 4,  # inside the last tensor's name
        "tensor data": len(data) // 2,
    }[cut]
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[:end])
    config = load_config(resolve_source(good_file))
    with pytest.raises(CheckpointError, match=f"truncated GGUF file: {message}") as err:
        gguf_tensors(path, config)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("dims", [[0, 64], [2**32, 2**32], [0, 2**63]])
def test_dimensions_no_tensor_can_have_are_named(good_file, tmp_path, dims):
    path = tmp_path / "dims.gguf"
    path.write_bytes(good_file.read_bytes())
    reader = GGUFReader(path, "r+")
    [tensor] = [t for t in reader.tensors if t.name == "token_embd.weight"]
    tensor.field.parts[3][:] = dims  # the tensor info's dimensions
    reader.data.flush()
    del reader
    for load in (read_gguf, load_tokenizer, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(CheckpointError, match=rf"dims.gguf: tensor 'token_embd.weight' has dimensions "
                                                  rf"\[{dims[0]}, {dims[1]}\]: each must be positive"):
            load(path)


@pytest.mark.parametrize(
    "version, message",
    [((1).to_bytes(4, "little"), "GGUF version 1 is not supported"), ((3).to_bytes(4, "big"), "big-endian")],
)
def test_unsupported_gguf_version(good_file, tmp_path, version, message):
    data = bytearray(good_file.read_bytes())
    data[4:8] = version  # the version follows the 4-byte magic
    path = tmp_path / "version.gguf"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=message) as err:
        read_gguf(path)
    assert str(path) in str(err.value)


def test_garbage_file(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(CheckpointError, match="magic") as err:
        AutoModelForCausalLM.from_pretrained(str(path))
    assert str(path) in str(err.value)


def test_architecture_transformers_rejects(tmp_path):
    """transformers cannot build a config for a GGUF 'bert': zoo reports it against the file."""
    path = tmp_path / "bert.gguf"
    write_llama_gguf(path, T.F32, arch="bert")
    with pytest.raises(CheckpointError, match="architecture bert is not supported") as err:
        AutoModelForCausalLM.from_pretrained(str(path))
    assert str(path) in str(err.value)


def test_architecture_gguf_reader_rejects(tmp_path):
    """A GGUF 'mistral' builds a MistralConfig zoo has a model for, but zoo's GGUF reader does
    not know that architecture's tensor layout (q/k permuted or not), so it refuses the file."""
    path = tmp_path / "mistral.gguf"
    write_llama_gguf(path, T.F32, arch="mistral")
    with pytest.raises(CheckpointError, match="GGUF architecture 'mistral' is not supported") as err:
        AutoModelForCausalLM.from_pretrained(str(path))
    assert str(path) in str(err.value)


def test_architecture_without_zoo_model(tmp_path):
    """A GGUF 'falcon' builds a config, but zoo has no model for it: the registry's error, which
    names the file and lists the supported architectures (before the file's tensors are read)."""
    path = tmp_path / "falcon.gguf"
    write_llama_gguf(path, T.F32, arch="falcon")
    with pytest.raises(UnsupportedArchitectureError, match=r"falcon\.gguf: architecture 'FalconForCausalLM' is not supported.*LlamaForCausalLM"):
        AutoModelForCausalLM.from_pretrained(str(path))
