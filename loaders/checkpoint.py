"""Where a checkpoint is (a local directory or file, or a hub download) and its tensors, in
whichever format it is stored."""

import os
import re
from pathlib import Path

from loaders.fp8 import dequantised_fp8
from loaders.gguf_file import gguf_tensors
from loaders.hf_dir import safetensors_tensors
from loaders.mxfp4 import dequantised_mxfp4, is_mxfp4
from loaders.types import CheckpointError, Source, TensorRef

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# What a hub download fetches: configs (model, generation, tokenizer, processor, preprocessor, chat
# template), weights, tokenizer vocabularies and chat templates (chat_template.jinja and
# additional_chat_templates/*.jinja); never pickles or code.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def resolve_source(path_or_repo_id) -> Source:
    """A local directory or ``.gguf`` file; otherwise a hub repo id, downloaded with huggingface_hub."""
    if not isinstance(path_or_repo_id, (str, os.PathLike)):
        raise TypeError(f"a checkpoint is a directory, a .gguf file or a hub repo id (a str or a path), "
                        f"got {type(path_or_repo_id).__name__}")
    text = str(path_or_repo_id)
    path = Path(text).expanduser()
    if path.is_dir():
        return Source(path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path}: a checkpoint is a directory (config.json + *.safetensors) or a .gguf file")
        return Source(path.parent, path.name)
    if not _REPO_ID.match(text) or text.startswith((".", "~")):
        raise FileNotFoundError(f"no such checkpoint directory or file: {path}")
    return Source(_download(text))


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # network, auth, missing repo: all end the same way for the caller
        raise CheckpointError(
            f"{repo_id!r} is not a local path, and downloading it from the hub failed: {exc}"
        ) from exc


def open_checkpoint(source: Source, config) -> dict[str, TensorRef]:
    """Every tensor of the checkpoint by its HuggingFace name; quantised tensors (GGUF blocks, FP8
    blocks with their scales, MXFP4 blocks with theirs) as the float tensors they dequantise to when read."""
    if source.gguf_file:
        return gguf_tensors(source.path, config)
    tensors, config_file = safetensors_tensors(source.directory), source.directory / "config.json"
    if is_mxfp4(config):
        return dequantised_mxfp4(tensors, config_file)
    return dequantised_fp8(tensors, config, config_file)
