"""The HuggingFace config object of a checkpoint (never with remote code)."""

import json

from loaders.checkpoint import resolve_source
from loaders.gguf_file import ARCHITECTURES, config_dict, read_gguf
from loaders.types import CheckpointError, Source


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
        config = _gguf_config(source) if source.gguf_file is not None else None
        if config is None:
            config = AutoConfig.from_pretrained(str(source.directory), gguf_file=source.gguf_file, trust_remote_code=False)
        return config
    except CheckpointError:  # zoo's GGUF reader names the damage itself
        raise
    except Exception as exc:  # transformers raises ValueError/OSError/KeyError for bad configs
        raise CheckpointError(f"{source.path}: transformers cannot build a config from it ({exc})") from exc


def _gguf_config(source: Source):
    """The config of a GGUF file zoo's reader takes, from the header that reader reads: in
    milliseconds, where transformers' own reading of the file takes seconds
    (``loaders.gguf_file.config_dict``). None: an architecture zoo's reader does not take, or
    fields the mapping cannot give; transformers then reads the file (and names what it cannot take)."""
    from transformers import AutoConfig

    gguf = read_gguf(source.path)
    fields = config_dict(gguf) if gguf.architecture in ARCHITECTURES else None
    if fields is None:
        return None
    config = AutoConfig.for_model(**fields)
    config._name_or_path = str(source.directory)  # as from_pretrained records it
    return config


def load_tokenizer(path_or_repo_id):
    """transformers' tokenizer of the checkpoint (GGUF included), or None when it has none."""
    import transformers

    source = resolve_source(path_or_repo_id)
    try:
        tokenizer_class = _gguf_tokenizer_class(source) or transformers.AutoTokenizer
        return tokenizer_class.from_pretrained(str(source.directory), gguf_file=source.gguf_file)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def load_processor(path_or_repo_id):
    """transformers' processor of a checkpoint whose model takes images (its image processor, the
    tokenizer and the chat template), or None when the checkpoint has no image processor."""
    import transformers

    source = resolve_source(path_or_repo_id)
    if source.gguf_file is not None:
        return None
    try:
        processor = transformers.AutoProcessor.from_pretrained(str(source.directory), trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return processor if hasattr(processor, "image_processor") else None


def _gguf_tokenizer_class(source: Source):
    """The class AutoTokenizer picks for a GGUF file zoo's reader takes, with no tokenizer_config.json
    beside it: the one transformers registers for the config's type. AutoTokenizer builds that config
    by reading the whole file (~4 s on SmolLM2); zoo's reader builds the same config from the header
    in milliseconds. None, to let AutoTokenizer pick, in every other case."""
    if source.gguf_file is None or (source.directory / "tokenizer_config.json").exists():
        return None
    config = _gguf_config(source)
    if config is None or getattr(config, "tokenizer_class", None):
        return None
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    tokenizer_class = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    # Mistral's own backend depends on more than the config: AutoTokenizer decides.
    return None if tokenizer_class is None or tokenizer_class.__name__ == "MistralCommonBackend" else tokenizer_class
