"""A checkpoint is data: zoo never runs code that ships with it, and never reads outside it."""

import builtins
import json
import re

import pytest
import torch
import transformers
from gguf import GGUFReader

from loaders import CheckpointError, from_checkpoint, load_config, load_tokenizer, resolve_source
from loaders.gguf_file import read_gguf
from models import AutoModelForCausalLM
from tests.conftest import tiny_config
from tests.loaders.gguf_writer import T, write_llama_gguf

# Code that leaves a mark beside itself when it runs.
PLANTED = """
import pathlib
pathlib.Path(__file__).with_name("MARKER").write_text("ran")
from transformers import PretrainedConfig, PreTrainedTokenizerFast, ProcessorMixin
class PlantedConfig(PretrainedConfig):
    model_type = "planted"
class PlantedTokenizer(PreTrainedTokenizerFast):
    pass
class PlantedProcessor(ProcessorMixin):
    pass
"""


@pytest.fixture
def planted(make_checkpoint, monkeypatch):
    """A checkpoint with planted.py beside it, and a user who answers yes to transformers' prompt."""
    path, _ = make_checkpoint(tiny_config("llama"))
    (path / "planted.py").write_text(PLANTED)
    asked = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": asked.append(prompt) or "y")
    yield path
    assert not asked, "transformers asked whether to run the checkpoint's code"
    assert not (path / "MARKER").exists(), "the checkpoint's code ran"


def test_a_tokenizer_with_code_is_refused_and_not_run(planted):
    (planted / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PlantedTokenizer", "auto_map": {"AutoTokenizer": ["planted.PlantedTokenizer", None]}}
    ))
    with pytest.raises(CheckpointError, match=r"ckpt: AutoTokenizer needs code that the checkpoint ships.*"
                                              r"zoo never runs code from a checkpoint"):
        load_tokenizer(planted)


def test_a_config_with_code_is_refused_and_not_run(planted):
    (planted / "config.json").write_text(json.dumps(
        {"model_type": "planted", "auto_map": {"AutoConfig": "planted.PlantedConfig"}}
    ))
    with pytest.raises(CheckpointError, match=r"zoo never runs code from a checkpoint"):
        load_config(resolve_source(planted))


def test_a_processor_with_code_is_refused_and_not_run(planted):
    (planted / "processor_config.json").write_text(json.dumps(
        {"processor_class": "PlantedProcessor", "auto_map": {"AutoProcessor": "planted.PlantedProcessor"}}
    ))
    with pytest.raises(CheckpointError, match=r"AutoProcessor needs code that the checkpoint ships"):
        from_checkpoint(transformers.AutoProcessor, resolve_source(planted))


def test_a_known_config_with_an_auto_map_loads_without_its_code(planted):
    """DeepSeek-V3's config.json names its own modeling code; transformers' built-in class serves it."""
    fields = json.loads((planted / "config.json").read_text())
    fields["auto_map"] = {"AutoConfig": "planted.PlantedConfig"}
    (planted / "config.json").write_text(json.dumps(fields))
    assert type(load_config(resolve_source(planted))).__name__ == "LlamaConfig"


def test_a_hub_download_fetches_what_tokenizers_and_processors_need_and_no_code(monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    needed = [
        "config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.tiktoken", "chat_template.jinja",
        "additional_chat_templates/tool_use.jinja", "chat_template.json", "processor_config.json",
        "preprocessor_config.json", "video_preprocessor_config.json",
    ]
    refused = ["modeling_planted.py", "tokenization_planted.py", "pytorch_model.bin", "model.pt", "weights.pkl",
               "original/consolidated.00.pth", "setup.sh"]
    asked = {}

    def snapshot_download(repo_id, allow_patterns):
        asked["files"] = list(filter_repo_objects(needed + refused, allow_patterns=allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_source("zoo-test/planted").directory == tmp_path
    assert asked["files"] == needed


@pytest.mark.parametrize("shard", ["../other/model.safetensors", "/etc/model.safetensors", "sub/../../model.safetensors",
                                   "..\\\\model.safetensors", "", 7])
def test_shards_outside_the_checkpoint_are_refused(make_checkpoint, shard):
    path, _ = make_checkpoint(tiny_config("llama"), max_shard_size="40KB")
    outside = path.parent / "other"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(sorted(path.glob("model-*.safetensors"))[0].read_bytes())
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = shard
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"index\.json: weight_map entry 'model\.norm\.weight' names the shard "
                                              rf"{re.escape(repr(shard))}, which is not a file inside the checkpoint"):
        AutoModelForCausalLM.from_pretrained(path)


def test_a_shard_linked_from_elsewhere_loads(make_checkpoint, input_ids):
    """The hub cache keeps each file as a link to its blob outside the snapshot directory."""
    path, reference = make_checkpoint(tiny_config("llama"), max_shard_size="40KB")
    blobs = path.parent / "blobs"
    blobs.mkdir()
    for shard in path.glob("model-*.safetensors"):
        shard.rename(blobs / shard.name)
        shard.symlink_to(blobs / shard.name)
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.testing.assert_close(model(input_ids), reference(input_ids).logits, rtol=1e-5, atol=1e-5)


def _move_tensor(path, index, offset):
    reader = GGUFReader(path, "r+")
    reader.tensors[index].field.parts[-1][0] = offset
    reader.data.flush()
    return reader.tensors[index].name


def test_gguf_tensors_that_overlap_are_refused(tmp_path):
    path = tmp_path / "llama.gguf"
    write_llama_gguf(path, T.F32)
    first = GGUFReader(path).tensors[1]
    name = _move_tensor(path, 2, int(first.field.parts[-1][0]) + 32)  # inside tensor 1, still aligned
    with pytest.raises(CheckpointError, match=rf"llama\.gguf: damaged GGUF header: tensor '{re.escape(name)}' has "
                                              rf"offset \d+, expected \d+ \(right after the tensor before it"):
        read_gguf(path)


def test_gguf_tensors_at_unaligned_offsets_are_refused(tmp_path):
    path = tmp_path / "llama.gguf"
    write_llama_gguf(path, T.F32)
    name = _move_tensor(path, 1, int(GGUFReader(path).tensors[1].field.parts[-1][0]) + 4)
    with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(name)}' has offset \d+, expected \d+ "
                                              rf"\(right after the tensor before it, padded to 32 bytes\)"):
        read_gguf(path)


def test_a_gguf_tensor_read_with_a_smaller_type_is_refused(tmp_path):
    """F32 read as F16: the last tensor's bytes would load as other weights, leaving the file's tail unread."""
    path = tmp_path / "llama.gguf"
    write_llama_gguf(path, T.F32)
    reader = GGUFReader(path, "r+")
    last = reader.tensors[-1]
    last.field.parts[-2][0] = int(T.F16)  # the type, before the offset
    reader.data.flush()
    with pytest.raises(CheckpointError, match=r"llama\.gguf: damaged GGUF header: its tensors end at byte \d+, "
                                              r"but the file has \d+ bytes"):
        read_gguf(path)
