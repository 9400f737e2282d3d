"""A checkpoint is data: zoo never runs code that ships with it, and never reads outside it."""

import builtins
import json

import pytest
import transformers

from loaders import CheckpointError, load_config, load_tokenizer, resolve_source
from loaders.config import from_checkpoint
from tests.conftest import tiny_config

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
