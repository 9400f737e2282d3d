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
    # A GGUF file zoo reads: its config fields from zoo's header reader, in seconds less than
    # transformers' own reading of the file (``loaders.gguf_file.config_dict``).
    fields = _gguf_config_fields(source) if source.gguf_file is not None else None
    try:
        if fields is not None:
            config = AutoConfig.for_model(**fields)
            config._name_or_path = str(source.directory)  # as from_pretrained records it
            return config
        return AutoConfig.from_pretrained(str(source.directory), gguf_file=source.gguf_file, trust_remote_code=False)
    except Exception as exc:  # transformers raises ValueError/OSError/KeyError for bad configs
        raise CheckpointError(f"{source.path}: transformers cannot build a config from it ({exc})") from exc


def _gguf_config_fields(source: Source) -> dict | None:
    """None: an architecture zoo's GGUF reader does not take, or fields the mapping cannot give;
    transformers then reads the file (and names what it cannot take)."""
    from loaders.gguf_file import ARCHITECTURES, config_dict, read_gguf

    gguf = read_gguf(source.path)
    return config_dict(gguf) if gguf.architecture in ARCHITECTURES else None


def load_tokenizer(path_or_repo_id):
    """transformers' tokenizer of the checkpoint (GGUF included), or None when it has none."""
    import transformers

    source = resolve_source(path_or_repo_id)
    try:
        return transformers.AutoTokenizer.from_pretrained(str(source.directory), gguf_file=source.gguf_file)
    except (OSError, ValueError, TypeError, KeyError):
        return None
