"""Bad checkpoints fail early with an error that names the culprit."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models

from layers.weights import Shard
from loaders import CheckpointError, HostMemoryError, chat_template_error, load_tokenizer
from loaders.load import choose_layouts
from models import AutoModelForCausalLM, UnsupportedArchitectureError
from tests.conftest import hf_model, relative_error, save_checkpoint, tiny_config
from tests.loaders import gguf_writer
from tests.models.test_deepseek_v3 import YARN, deepseek_config
from tests.models.test_llava import hf_llava, llava_config
from tests.models.test_parity import COHERE_IDS


@pytest.fixture
def checkpoint(make_checkpoint):
    path, _ = make_checkpoint(tiny_config("llama"))
    return path


def rewrite_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor(checkpoint):
    rewrite_tensors(checkpoint, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.weight"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_a_tensor_read_in_parts_is_named_once_when_missing():
    # A rank's gate rows and up rows of a stacked gate_up_proj: two shards of one tensor.
    stacked = (Shard("gate_up", (slice(0, 2),), (slice(0, 2),)), Shard("gate_up", (slice(2, 4),), (slice(6, 8),)))
    layouts = {"experts.w": ((Shard("gate"), Shard("up")), stacked)}
    assert choose_layouts(layouts, {})[1] == ["gate (+1 more) or gate_up"]
    assert choose_layouts({"experts.w": (stacked,)}, {})[1] == ["gate_up"]
    targets, missing = choose_layouts(layouts, {"gate_up": None})
    assert missing == [] and targets == {"gate_up": [("experts.w", (slice(0, 2),), (slice(0, 2),), False),
                                                     ("experts.w", (slice(2, 4),), (slice(6, 8),), False)]}


def test_unexpected_tensor(checkpoint):
    rewrite_tensors(checkpoint, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*model\.layers\.0\.mlp\.extra\.weight \(model\.safetensors\)"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_wrong_shape(checkpoint):
    rewrite_tensors(checkpoint, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(112, 60)}))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight'.*expected shape \(112, 64\), got \(112, 60\)"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_integer_tensor(checkpoint):
    rewrite_tensors(checkpoint, lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight'.*dtype I32 is not a floating-point type"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_truncated_safetensors(checkpoint):
    file = checkpoint / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_corrupt_safetensors(checkpoint):
    (checkpoint / "model.safetensors").write_bytes(b"\x07" * 1000)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_missing_shard(make_checkpoint):
    path, _ = make_checkpoint(tiny_config("llama"), max_shard_size="40KB")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard files that do not exist: \\['{shard.name}'\\]"):
        AutoModelForCausalLM.from_pretrained(path)


def test_an_index_of_no_tensors(make_checkpoint):
    path, _ = make_checkpoint(tiny_config("llama"), max_shard_size="40KB")
    index = path / "model.safetensors.index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "weight_map": {}}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: its weight_map lists no tensors"):
        AutoModelForCausalLM.from_pretrained(path)


def test_no_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors.*pytorch_model\.bin.*never loaded"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"ckpt: no config\.json"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_malformed_config(checkpoint):
    (checkpoint / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(CheckpointError, match=r"config\.json: malformed JSON"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def save_tokenizer(path):
    """A word-level tokenizer of two words, as transformers saves one: tokenizer_config.json beside tokenizer.json."""
    words = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(path)
    return path


@pytest.mark.parametrize("name, text, message", [
    ("tokenizer.json", None, "malformed JSON"),
    ("tokenizer.json", '{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}}',  # merges a token it lacks
     r"the checkpoint's tokenizer cannot be built \(Token `b` out of vocabulary"),
    ("tokenizer_config.json", None, "malformed JSON"),
    ("special_tokens_map.json", '{"unk_token": ', "malformed JSON"),  # a legacy file transformers still reads
])
def test_a_damaged_tokenizer_file_is_named_among_the_others(tmp_path, name, text, message):
    path = save_tokenizer(tmp_path / "ckpt") / name
    path.write_text(text or path.read_text()[:60])  # no text: the file cut short
    with pytest.raises(CheckpointError, match=rf"ckpt/{name}: {message}"):
        load_tokenizer(tmp_path / "ckpt")


@pytest.mark.parametrize("tokenizer_class", ["LlamaTokenizerFast", "Qwen2TokenizerFast", "GPT2TokenizerFast", "GemmaTokenizerFast"])
def test_a_tokenizer_config_without_its_vocabulary_is_an_error(tmp_path, tokenizer_class):
    """transformers builds it into a tokenizer of the special tokens alone, which encodes every text as []."""
    path = save_tokenizer(tmp_path / "ckpt")
    assert load_tokenizer(path).encode("b", add_special_tokens=False) == [2]
    (path / "tokenizer.json").unlink()
    fields = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**fields, "tokenizer_class": tokenizer_class}))
    with pytest.raises(CheckpointError, match=r"ckpt/tokenizer_config\.json: the checkpoint's tokenizer has no "
                                              r"vocabulary beyond its \d+ special tokens \(is its vocabulary file"):
        load_tokenizer(path)


def test_a_chat_template_that_does_not_compile_is_named_with_the_file_that_holds_it(tmp_path, monkeypatch):
    broken = "{% for m in messages %}{{ m['content'] }}"  # a for without its endfor
    does_not_compile = ": the chat template does not compile (line 1: Unexpected end of template"
    path = save_tokenizer(tmp_path / "ckpt")
    assert chat_template_error(load_tokenizer(path), path) is None  # no template
    # tokenizer_config.json's named templates, of which a chat renders the default one
    fields = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**fields, "chat_template": [
        {"name": "default", "template": broken}, {"name": "tool_use", "template": "{{ tools }}"}]}))
    tokenizer = load_tokenizer(path)
    assert chat_template_error(tokenizer, path).startswith(f"{path / 'tokenizer_config.json'}{does_not_compile}")
    # a tokenizer not from a checkpoint
    assert chat_template_error(tokenizer).startswith(f"{type(tokenizer).__name__}.chat_template{does_not_compile}")
    # a GGUF file's metadata
    monkeypatch.setattr(gguf_writer, "CHAT_TEMPLATE", broken)
    gguf_writer.write_llama_gguf(tmp_path / "llama.gguf", gguf_writer.T.F32, tokenizer="gpt2")
    assert chat_template_error(load_tokenizer(tmp_path / "llama.gguf"), tmp_path / "llama.gguf").startswith(
        f"{tmp_path / 'llama.gguf'} (its tokenizer.chat_template metadata){does_not_compile}")


def test_a_jinja2_older_than_transformers_takes_is_a_chat_template_error(tmp_path, monkeypatch):
    # transformers refuses to compile any template under an older jinja2 with an ImportError (how it
    # checks the version differs between its releases): the refusal is the error, not a crash at load.
    def refuse(template):
        raise ImportError("apply_chat_template requires jinja2>=3.1.6 to be installed.")

    monkeypatch.setattr("transformers.utils.chat_template_utils._compile_jinja_template", refuse)
    tokenizer = load_tokenizer(save_tokenizer(tmp_path / "ckpt"))
    tokenizer.chat_template = "{{ messages }}"
    assert chat_template_error(tokenizer) == "apply_chat_template requires jinja2>=3.1.6 to be installed."


def test_config_transformers_rejects(checkpoint):
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(CheckpointError, match=r"ckpt: transformers cannot build a config"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


@pytest.mark.parametrize("field, value, message", [
    ("hidden_act", "gelu_fancy", r"ckpt: unsupported hidden_act 'gelu_fancy'; supported: "),
    ("rope_parameters", {"rope_type": "bogus", "rope_theta": 10000.0}, r"ckpt: unsupported rope_type 'bogus'; supported: "),
])
def test_a_config_value_no_layer_takes_names_the_checkpoint(checkpoint, field, value, message):
    fields = json.loads((checkpoint / "config.json").read_text())
    fields[field] = value
    (checkpoint / "config.json").write_text(json.dumps(fields))
    with pytest.raises(CheckpointError, match=message):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_unknown_architecture(checkpoint):
    fields = json.loads((checkpoint / "config.json").read_text())
    fields["architectures"] = ["FooForCausalLM"]
    (checkpoint / "config.json").write_text(json.dumps(fields))
    with pytest.raises(UnsupportedArchitectureError, match=r"ckpt: architecture 'FooForCausalLM'.*supported: .*LlamaForCausalLM.*Qwen3ForCausalLM"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


@pytest.mark.parametrize("path", ["/no/such/dir", "./not-here", "missing-dir"])
def test_nonexistent_path(path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory or file"):
        AutoModelForCausalLM.from_pretrained(path)


def test_not_a_checkpoint_file(tmp_path):
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"weights\.txt: a checkpoint is a directory"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "weights.txt")


def test_hub_download_failure_is_clear(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match=r"'zoo-test/no-such-repo' is not a local path, and downloading it"):
        AutoModelForCausalLM.from_pretrained("zoo-test/no-such-repo")


def test_bad_input_ids(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    with pytest.raises(ValueError, match=r"outside \[0, 97\): min 0, max 97"):
        model(torch.tensor([[0, 97]]))
    with pytest.raises(ValueError, match=r"\[batch, seq_len\].*\(3,\)"):
        model(torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match=r"input_ids must be a torch.long \(or int32\) tensor of token ids, got a torch.float32"):
        model(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(TypeError, match=r"input_ids must be .* tensor of token ids, got list"):
        model([[1, 2]])


@pytest.mark.parametrize("option, error, message", [
    (dict(keep_fp8="no"), TypeError, "keep_fp8 must be None, True or False, got 'no'"),
    (dict(mmap="no"), TypeError, "mmap must be True or False, got 'no'"),
    (dict(tensor_parallel=2), TypeError, r"tensor_parallel must be a torch.distributed process group .* got 2; "
                                         r"LLM\(..., tensor_parallel_size=N\) starts the ranks"),
    (dict(expert_parallel=True), ValueError, "expert_parallel says how tensor_parallel's ranks split the experts"),
], ids=lambda value: next(iter(value)) if isinstance(value, dict) else None)
def test_bad_from_pretrained_arguments_are_named_before_the_checkpoint_opens(checkpoint, option, error, message,
                                                                              monkeypatch):
    import models.auto

    def no_loading(*args, **kwargs):
        raise AssertionError("the checkpoint was opened before the arguments were checked")

    monkeypatch.setattr(models.auto, "resolve_source", no_loading)
    with pytest.raises(error, match=message):
        AutoModelForCausalLM.from_pretrained(checkpoint, **option)


@pytest.mark.parametrize("model", [None, 5, ["ckpt"], {"model.embed_tokens.weight": torch.zeros(2)}], ids=str)
def test_a_model_argument_that_is_no_checkpoint_is_a_type_error(model):
    from runtime import LLM

    with pytest.raises(TypeError, match=r"a checkpoint is a directory, a .gguf file or a hub repo id \(a str or a path\), "
                                        rf"got {type(model).__name__}"):
        AutoModelForCausalLM.from_pretrained(model)
    with pytest.raises(TypeError, match=r"LLM takes a checkpoint \(a directory, a .gguf file or a hub repo id\) or a zoo "
                                        rf"model, got {type(model).__name__}"):
        LLM(model)


@pytest.mark.parametrize("option, message", [
    (dict(dtype="bogus"), "dtype must be a floating-point torch dtype"),
    (dict(dtype="int8"), "dtype must be a floating-point torch dtype"),
    (dict(device="tpu9"), "device 'tpu9' is not a device torch knows"),
    (dict(device="meta"), "device 'meta' holds no values: a model cannot compute on it"),
    (dict(block_size=0), "block_size must be a positive integer, got 0"),
    (dict(max_num_seqs=0), "max_num_seqs must be a positive integer, got 0"),
    (dict(max_model_len=0), "max_model_len must be a positive integer, got 0"),
    (dict(num_blocks=-1), "num_blocks must be a positive integer, got -1"),
    (dict(max_num_batched_tokens=2.5), "max_num_batched_tokens must be a positive integer, got 2.5"),
    (dict(kv_cache_gib=0), "kv_cache_gib must be a finite number of GiB > 0, got 0"),
    (dict(kv_cache_gib="1"), "kv_cache_gib must be a finite number of GiB > 0, got '1'"),
    (dict(kv_cache_gib=float("inf")), "kv_cache_gib must be a finite number of GiB > 0, got inf"),
    (dict(kv_cache_gib=1e300), "kv_cache_gib must be a finite number of GiB > 0, got 1e\\+300"),
    (dict(kv_cache_gib=float("nan")), "kv_cache_gib must be a finite number of GiB > 0, got nan"),
    (dict(block_size=True), "block_size must be a positive integer, got True"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
    (dict(gpu_memory_utilization=float("nan")), r"gpu_memory_utilization must be in \(0, 1\], got nan"),
    (dict(gpu_memory_utilization=float("-inf")), r"gpu_memory_utilization must be in \(0, 1\], got -inf"),
    (dict(enforce_eager="yes"), "enforce_eager must be True or False, got 'yes'"),
    (dict(attention_backend="flash"), r"unknown attention backend 'flash'; choose one of \['torch', 'triton'\]"),
    (dict(max_num_seq=8), "unknown engine option 'max_num_seq'; the options are max_num_seqs, max_model_len, "),
    (dict(config={"max_num_seqs": 4}), r"config must be an EngineConfig \(or left out, options given by name\), "
                                       r"got \{'max_num_seqs': 4\}"),
], ids=lambda value: next(iter(value)) if isinstance(value, dict) else None)
def test_bad_llm_options_are_named_before_the_model_loads(checkpoint, option, message, monkeypatch):
    import models.auto
    from runtime import LLM

    def no_loading(*args, **kwargs):
        raise AssertionError("the checkpoint was opened before the options were checked")

    monkeypatch.setattr(models.auto, "resolve_source", no_loading)
    with pytest.raises((ValueError, TypeError), match=message):
        LLM(str(checkpoint), **{"device": "cpu", **option})


def test_from_pretrained_takes_a_dtype_by_name_and_refuses_others(checkpoint):
    assert next(AutoModelForCausalLM.from_pretrained(checkpoint, dtype="bfloat16").parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be a floating-point torch dtype .* got torch.int8"):
        AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.int8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is missing")
def test_cuda_asked_for_without_cuda(checkpoint):
    from runtime import LLM

    with pytest.raises(ValueError, match="device 'cuda' asked for, but this torch sees no CUDA device"):
        LLM(str(checkpoint), device="cuda")
    with pytest.raises(ValueError, match="device 0 is not a device torch knows"):  # CUDA device 0, not the default
        LLM(str(checkpoint), device=0)


@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", -64, r"config field 'hidden_size' must be a positive integer, got -64"),
    ("max_position_embeddings", 0, r"config field 'max_position_embeddings' must be a positive integer, got 0"),
    ("num_key_value_heads", 0, r"config field 'num_key_value_heads' must be a positive integer, got 0"),
    ("head_dim", 2**24, r"config field 'head_dim' is 16777216, more than the checkpoint's \d+ elements can hold"),
    ("intermediate_size", 2**40, r"config field 'intermediate_size' is 1099511627776, more than the checkpoint's"),
    ("num_hidden_layers", 100_000, r"config field 'num_hidden_layers' is 100000, more than the checkpoint's 21 tensors"),
    # transformers versions that type-check a config's fields (5.17) name it first, in their words.
    ("architectures", "LlamaForCausalLM", r"config field 'architectures' must be a list of class names, got "
                                          r"'LlamaForCausalLM'|Field 'architectures' with value 'LlamaForCausalLM'"),
    ("num_key_value_heads", 3, r"config field 'num_attention_heads' \(4\) is not a multiple of 'num_key_value_heads' \(3\)"),
])
def test_config_fields_that_size_the_model_are_checked_before_it_is_built(checkpoint, field, value, message, monkeypatch):
    import models.auto

    def no_building(*args, **kwargs):
        raise AssertionError("the model was built before its config was checked")

    monkeypatch.setattr(models.auto, "_build_on_meta", no_building)
    fields = json.loads((checkpoint / "config.json").read_text())
    fields[field] = value
    (checkpoint / "config.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_pretrained(checkpoint)


TINY_MODELS = {
    "llama": lambda: hf_model(tiny_config("llama")),
    "gemma2": lambda: hf_model(tiny_config("gemma2", head_dim=16)),
    "deepseek_v3": lambda: hf_model(deepseek_config()),
    "llava": lambda: hf_llava(llava_config()),
    "qwen3_moe": lambda: hf_model(tiny_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "granite": lambda: hf_model(tiny_config("granite")),
    "granitemoeshared": lambda: hf_model(tiny_config("granitemoeshared", num_local_experts=4, num_experts_per_tok=2,
                                                     intermediate_size=32, shared_intermediate_size=48)),
    "gemma3": lambda: hf_model(tiny_config("gemma3_text", head_dim=16)),
    "olmoe": lambda: hf_model(tiny_config("olmoe", num_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                          clip_qkv=8.0, eos_token_id=2)),
    "cohere": lambda: hf_model(tiny_config("cohere", **COHERE_IDS)),
}
NAN, INF = float("nan"), float("inf")


def set_field(fields: dict, dotted_name: str, value):
    *parents, name = dotted_name.split(".")
    for parent in parents:
        fields = fields[parent]
    fields[name] = value


def test_an_unset_logit_scale_is_named(tmp_path):
    """Cohere's config takes a null logit_scale, which HF's model then multiplies by and fails."""
    path = save_checkpoint(TINY_MODELS["cohere"](), tmp_path / "ckpt")
    fields = json.loads((path / "config.json").read_text())
    fields["logit_scale"] = None
    (path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(CheckpointError,
                       match=r"ckpt: config field 'logit_scale' is not set; the model computes with it"):
        AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("model, field, value, message", [
    ("llama", "rms_norm_eps", -1.0, r"'rms_norm_eps' must be a finite positive number, got -1\.0"),
    ("llama", "rms_norm_eps", NAN, r"'rms_norm_eps' must be a finite positive number, got nan"),
    ("llama", "rms_norm_eps", 0.0, r"'rms_norm_eps' must be a finite positive number, got 0\.0"),
    ("llama", "rope_parameters.rope_theta", -10000.0, r"'rope_parameters\.rope_theta' must be a finite positive number, got -10000\.0"),
    ("llama", "rope_parameters.rope_theta", 0, r"'rope_parameters\.rope_theta' must be a finite positive number, got 0$"),
    ("llama", "rope_parameters.rope_theta", NAN, r"'rope_parameters\.rope_theta' must be a finite positive number, got nan"),
    ("llama", "rope_parameters.rope_theta", "1e4", r"'rope_parameters\.rope_theta' must be a finite positive number, got '1e4'"),
    ("llama", "rope_parameters", {"rope_type": "linear", "factor": 0.0, "rope_theta": 1e4},
     r"'rope_parameters\.factor' must be a finite positive number, got 0\.0"),
    ("llama", "rope_parameters", {"rope_type": "dynamic", "factor": -2.0, "rope_theta": 1e4},
     r"'rope_parameters\.factor' must be a finite positive number, got -2\.0"),
    ("llama", "rope_parameters", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 16, "rope_theta": 5e5},
     r"'rope_parameters\.low_freq_factor' must be a finite positive number, got 0\.0"),
    ("llama", "rope_parameters", {**YARN, "original_max_position_embeddings": -16},
     r"'rope_parameters\.original_max_position_embeddings' must be a finite positive number, got -16"),
    ("llama", "rope_parameters", {**YARN, "attention_factor": INF},
     r"'rope_parameters\.attention_factor' must be a finite positive number, got inf"),
    ("llama", "rope_parameters", {**YARN, "beta_fast": -32.0},
     r"'rope_parameters\.beta_fast' must be a finite non-negative number, got -32\.0"),
    ("gemma2", "attn_logit_softcapping", -50.0, r"'attn_logit_softcapping' must be a finite positive number, got -50\.0"),
    ("gemma2", "final_logit_softcapping", 0.0, r"'final_logit_softcapping' must be a finite positive number, got 0\.0"),
    ("gemma2", "query_pre_attn_scalar", -24, r"'query_pre_attn_scalar' must be a finite positive number, got -24"),
    ("deepseek_v3", "routed_scaling_factor", INF, r"'routed_scaling_factor' must be a finite positive number, got inf"),
    ("gemma3", "rope_parameters.full_attention.rope_theta", -1.0,
     r"'rope_parameters\.full_attention\.rope_theta' must be a finite positive number, got -1\.0"),
    ("granite", "logits_scaling", 0.0, r"'logits_scaling' must be a finite positive number, got 0\.0"),
    ("granite", "residual_multiplier", NAN, r"'residual_multiplier' must be a finite positive number, got nan"),
    # 0: no shared MLP (a size that may be zero)
    ("granitemoeshared", "shared_intermediate_size", -48,
     r"'shared_intermediate_size' must be a non-negative integer, got -48"),
    ("olmoe", "clip_qkv", 0.0, r"'clip_qkv' must be a finite positive number, got 0\.0"),
    ("cohere", "logit_scale", -0.0625, r"'logit_scale' must be a finite positive number, got -0\.0625"),
    ("deepseek_v3", "rope_parameters", {**YARN, "mscale_all_dim": NAN},
     r"'rope_parameters\.mscale_all_dim' must be a finite non-negative number, got nan"),
    ("llava", "text_config.rms_norm_eps", NAN, r"'text_config\.rms_norm_eps' must be a finite positive number, got nan"),
    ("llava", "vision_config.layer_norm_eps", -1e-5,
     r"'vision_config\.layer_norm_eps' must be a finite positive number, got -1e-05"),
    ("llava", "text_config.hidden_size", 0, r"'text_config\.hidden_size' must be a positive integer, got 0"),
    # Counts a layer divides by
    ("qwen3_moe", "decoder_sparse_step", 0, r"'decoder_sparse_step' must be a positive integer, got 0"),
    ("deepseek_v3", "n_group", 0, r"'n_group' must be a positive integer, got 0"),
    ("deepseek_v3", "topk_group", 0, r"'topk_group' must be a positive integer, got 0"),
    ("llava", "vision_config.patch_size", 0, r"'vision_config\.patch_size' must be a positive integer, got 0"),
])
def test_config_numbers_a_layer_computes_with_are_checked_before_it_is_built(tmp_path, model, field, value, message,
                                                                             monkeypatch):
    import models.auto

    path = save_checkpoint(TINY_MODELS[model](), tmp_path / "ckpt")

    def no_building(*args, **kwargs):
        raise AssertionError("the model was built before its config was checked")

    monkeypatch.setattr(models.auto, "_build_on_meta", no_building)
    fields = json.loads((path / "config.json").read_text())
    set_field(fields, field, value)
    (path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(CheckpointError, match=r"ckpt: config field " + message):
        AutoModelForCausalLM.from_pretrained(path)


def test_config_numbers_where_null_or_zero_means_none_load_and_compute_as_hf(tmp_path, input_ids):
    """Soft-caps of null (no capping), YaRN's betas and mscales of zero (the defaults), read as HF reads them."""
    gemma2 = tiny_config("gemma2", head_dim=16, attn_logit_softcapping=None, final_logit_softcapping=None)
    yarn = tiny_config("llama", rope_parameters={**YARN, "beta_fast": 0, "beta_slow": 0, "mscale": 0, "mscale_all_dim": 0})
    for name, config in {"gemma2": gemma2, "yarn": yarn}.items():
        reference = hf_model(config)
        model = AutoModelForCausalLM.from_pretrained(save_checkpoint(reference, tmp_path / name))
        with torch.no_grad():
            assert relative_error(model(input_ids), reference(input_ids).logits) <= 1e-5, name


@pytest.mark.parametrize("key, value, message", [
    ("llama.rope.dimension_count", 0x40000040, r"config field 'head_dim' is 1073741888, more than the checkpoint's"),
    ("llama.embedding_length", 0, r"config field 'hidden_size' must be a positive integer, got 0"),
    ("llama.block_count", 0xFFFFFFFF, r"config field 'num_hidden_layers' is 4294967295, more than the checkpoint's"),
    ("llama.attention.layer_norm_rms_epsilon", -1.0, r"config field 'rms_norm_eps' must be a finite positive number"),
    ("llama.rope.freq_base", NAN, r"config field 'rope_parameters\.rope_theta' must be a finite positive number, got nan"),
])
def test_gguf_metadata_is_checked_before_the_model_is_built(tmp_path, key, value, message):
    from gguf import GGUFReader

    from tests.loaders.gguf_writer import T, write_llama_gguf

    path = tmp_path / "llama.gguf"
    write_llama_gguf(path, T.F32)
    reader = GGUFReader(path, "r+")
    reader.fields[key].parts[-1][0] = value
    reader.data.flush()
    del reader
    with pytest.raises(CheckpointError, match=r"llama\.gguf: " + message):
        AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("slice_elements", [1 << 24, 100], ids=["whole", "slices"])
def test_nan_or_inf_in_a_weight_is_named_in_a_warning(checkpoint, slice_elements, monkeypatch):
    import warnings

    import loaders.load
    from loaders import NonFiniteWeightWarning

    monkeypatch.setattr(loaders.load, "FINITE_CHECK_ELEMENTS", slice_elements)  # rows 3 and 4 in different slices

    def poison(tensors):
        tensors["model.layers.1.mlp.down_proj.weight"][3, :5] = float("nan")
        tensors["model.layers.1.mlp.down_proj.weight"][4, 0] = float("-inf")

    rewrite_tensors(checkpoint, poison)
    with pytest.warns(NonFiniteWeightWarning, match=r"tensor 'model\.layers\.1\.mlp\.down_proj\.weight' in .*"
                                                    r"model\.safetensors: 6 of 7168 values are NaN or Inf") as caught:
        AutoModelForCausalLM.from_pretrained(checkpoint, dtype="bfloat16")
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteWeightWarning)
        with pytest.raises(NonFiniteWeightWarning, match="down_proj"):
            AutoModelForCausalLM.from_pretrained(checkpoint)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", [(0, 0), (3, 17), (-1, -1)], ids=["first", "inside", "last"])
def test_a_single_nan_or_inf_anywhere_in_a_weight_is_found(checkpoint, value, where):
    from loaders import NonFiniteWeightWarning

    def poison(tensors):
        tensors["model.layers.0.self_attn.o_proj.weight"][where] = value

    rewrite_tensors(checkpoint, poison)
    with pytest.warns(NonFiniteWeightWarning, match=r"o_proj\.weight' in .*: 1 of \d+ values are NaN or Inf"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def storage_bytes(model) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_a_model_larger_than_the_free_host_memory_is_named_before_its_weights_are_read(checkpoint, monkeypatch):
    """The memory a model takes on the CPU, its parameters that map their file left out, against what
    the host has available: over it, a HostMemoryError (a ValueError, as the CLI reports) names the
    checkpoint's file and both sizes before a tensor is read, with what would make the model smaller."""
    needed = storage_bytes(AutoModelForCausalLM.from_pretrained(checkpoint, mmap=False))  # every tensor copied
    monkeypatch.setattr("loaders.load.available_host_memory", lambda: needed)
    AutoModelForCausalLM.from_pretrained(checkpoint, mmap=False)
    monkeypatch.setattr("loaders.load.available_host_memory", lambda: needed - 1)
    AutoModelForCausalLM.from_pretrained(checkpoint)  # the embeddings and norms map the float32 file
    monkeypatch.setattr("loaders.load.fill", lambda *args, **kwargs: pytest.fail("a tensor was read"))
    message = (rf"{checkpoint / 'model.safetensors'}: the model needs \d+\.\d GiB of memory in torch.float32 on "
               r"the CPU, and \d+\.\d GiB are available; a 16-bit dtype \(--dtype bfloat16\) halves torch.float32's "
               r"bytes$")
    with pytest.raises(HostMemoryError, match=message):
        AutoModelForCausalLM.from_pretrained(checkpoint, mmap=False)
    with pytest.raises(ValueError, match="GiB are available"):
        AutoModelForCausalLM.from_pretrained(checkpoint, mmap=False)
    monkeypatch.setattr("loaders.load.available_host_memory", lambda: None)  # not known: not checked
    with pytest.raises(pytest.fail.Exception, match="a tensor was read"):
        AutoModelForCausalLM.from_pretrained(checkpoint, mmap=False)
