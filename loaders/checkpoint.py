"""Where a checkpoint is, and its tensors as lazy references (name, shape, dtype, how to read)."""

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor at fault."""


@dataclass(frozen=True)
class Source:
    """A local checkpoint: a HuggingFace directory, or a GGUF file (``gguf_file`` inside ``directory``)."""

    directory: Path
    gguf_file: str | None = None

    @property
    def path(self) -> Path:
        return self.directory / self.gguf_file if self.gguf_file else self.directory


@dataclass
class TensorRef:
    """A checkpoint tensor not read yet: ``load()`` returns it as a CPU tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: Path
    load: Callable[[], torch.Tensor]
    nbytes: int


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# What a hub download fetches: configs, weights and tokenizer files; never pickles or code.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]


def resolve_source(path_or_repo_id) -> Source:
    """A local directory or ``.gguf`` file; otherwise a hub repo id, downloaded with huggingface_hub."""
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


FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


def open_checkpoint(source: Source, config) -> dict[str, TensorRef]:
    """Every tensor of the checkpoint by its HuggingFace name."""
    if source.gguf_file:
        from loaders.gguf_file import gguf_tensors

        return gguf_tensors(source.path, config)
    from loaders.hf_dir import safetensors_tensors

    return safetensors_tensors(source.directory)
