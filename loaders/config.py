"""The HuggingFace config object of a checkpoint (never with remote code)."""

import json

from loaders.checkpoint import CheckpointError, Source, resolve_source


def load_config(source: Source):
    """``transformers.AutoConfig`` of a directory, or of a GGUF file's metadata."""
    from transformers import AutoConfig

    if source.gguf_file is None:
        path = source.directory / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{source.directory}: no config.json")
        try:
            json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: malformed JSON ({exc})") from exc
    try:
        return AutoConfig.from_pretrained(str(source.directory), gguf_file=source.gguf_file, trust_remote_code=False)
    except Exception as exc:  # transformers raises ValueError/OSError/KeyError for bad configs
        raise CheckpointError(f"{source.path}: transformers cannot build a config from it ({exc})") from exc


def load_tokenizer(path_or_repo_id):
    """transformers' tokenizer of the checkpoint (GGUF included), or None when it has none."""
    import transformers

    source = resolve_source(path_or_repo_id)
    try:
        return transformers.AutoTokenizer.from_pretrained(str(source.directory), gguf_file=source.gguf_file)
    except (OSError, ValueError, TypeError, KeyError):
        return None
