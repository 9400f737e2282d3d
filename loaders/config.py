"""The HuggingFace config object and tokenizer of a checkpoint, never with code from it."""

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
        _check_json(path)
    try:
        config = _gguf_config(source) if source.gguf_file is not None else None
        if config is None:
            config = from_checkpoint(AutoConfig, source)
        return config
    except CheckpointError:  # zoo's GGUF reader names the damage itself
        raise
    except Exception as exc:  # transformers raises ValueError/OSError/KeyError for bad configs
        raise CheckpointError(f"{source.path}: transformers cannot build a config from it ({exc})") from exc


def _check_json(path) -> None:
    """A file that is not a JSON object is a CheckpointError naming it (transformers' JSONDecodeError
    names no file; a list or a string where it reads an object's fields fails as an AttributeError)."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: malformed JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not a JSON object (its top level is {type(value).__name__}: {value!r:.40})")


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


# Files whose presence in a directory declares a tokenizer (transformers reads them by these names).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "tekken.json", "tokenizer.tiktoken")
# The JSON files transformers reads to build a tokenizer: those that declare one, and legacy ones beside them.
TOKENIZER_JSON_FILES = (*(name for name in TOKENIZER_FILES if name.endswith(".json")),
                        "special_tokens_map.json", "added_tokens.json")


def from_checkpoint(factory, source: Source, **kwargs):
    """``factory.from_pretrained`` (a transformers config, tokenizer, processor, generation config or
    model class) on a local checkpoint, never running code from it: transformers builds its own
    classes and refuses a checkpoint that needs its code (an ``auto_map`` without a built-in
    equivalent), which becomes a CheckpointError. Every transformers call on a checkpoint goes
    through here."""
    if source.gguf_file is not None:
        kwargs["gguf_file"] = source.gguf_file
    try:
        return factory.from_pretrained(str(source.directory), trust_remote_code=False, **kwargs)
    except ValueError as exc:
        if "trust_remote_code" not in str(exc):
            raise
        raise CheckpointError(
            f"{source.path}: {factory.__name__} needs code that the checkpoint ships (an auto_map to a .py file); "
            f"zoo never runs code from a checkpoint"
        ) from exc


def load_generation_config(path_or_repo_id):
    """transformers' GenerationConfig of the checkpoint's ``generation_config.json``, or None where its
    directory has none. A file that cannot be read is a CheckpointError naming it."""
    from transformers import GenerationConfig

    directory = resolve_source(path_or_repo_id).directory
    path = directory / "generation_config.json"
    if not path.is_file():
        return None
    _check_json(path)
    try:
        return from_checkpoint(GenerationConfig, Source(directory))
    except CheckpointError:
        raise
    except Exception as exc:  # a field of the wrong type fails as a TypeError, an invalid value as a ValueError
        raise CheckpointError(f"{path}: {exc}") from exc


def load_tokenizer(path_or_repo_id):
    """transformers' tokenizer of the checkpoint (GGUF included); None for a checkpoint that has no
    tokenizer files (tokenizer metadata, for GGUF). A declared tokenizer that cannot be built is a
    CheckpointError naming the file at fault (else the file that declares the tokenizer) and the cause."""
    import transformers

    source = resolve_source(path_or_repo_id)
    declared = _tokenizer_declaration(source)
    if declared is None:
        return None
    try:
        tokenizer = from_checkpoint(_gguf_tokenizer_class(source) or transformers.AutoTokenizer, source)
    except CheckpointError:
        raise
    except Exception as exc:  # tokenizers, sentencepiece and transformers each raise their own types
        _check_tokenizer_files(source)
        raise CheckpointError(f"{declared}: the checkpoint's tokenizer cannot be built ({type(exc).__name__}: {exc})") from exc
    # transformers builds a tokenizer_config.json without its vocabulary file into one that encodes every
    # text as no tokens at all.
    if len(tokenizer) <= len(tokenizer.all_special_tokens):
        raise CheckpointError(f"{declared}: the checkpoint's tokenizer has no vocabulary beyond its {len(tokenizer)} "
                              f"special tokens (is its vocabulary file, one of {', '.join(TOKENIZER_FILES[1:])}, "
                              f"missing?)")
    return tokenizer


def _check_tokenizer_files(source: Source) -> None:
    """A tokenizer file that does not read is a CheckpointError naming it, where transformers' errors
    name no file. Checked once the tokenizer has failed to build: one that builds reads its files once."""
    import tokenizers

    for name in TOKENIZER_JSON_FILES:
        if (source.directory / name).is_file():
            _check_json(source.directory / name)
    path = source.directory / "tokenizer.json"
    if path.is_file():
        try:
            tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception
            raise CheckpointError(f"{path}: the checkpoint's tokenizer cannot be built ({exc})") from exc


def _tokenizer_declaration(source: Source) -> str | None:
    """What declares the checkpoint's tokenizer, for errors; None when nothing does."""
    files = [name for name in TOKENIZER_FILES if (source.directory / name).is_file()]
    if files:
        return str(source.directory / files[0])
    if source.gguf_file is not None:
        gguf = read_gguf(source.path)
        if any(key.startswith("tokenizer.ggml.") for key in (*gguf.metadata, *gguf.array_lengths)):
            return f"{source.path} (its tokenizer.ggml metadata)"
    return None


# The files in which a checkpoint declares a processor: an image processor's, or a whole processor's.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def load_processor(path_or_repo_id):
    """transformers' processor of a checkpoint whose model takes images (its image processor, the
    tokenizer and the chat template); None for a checkpoint without an image processor (neither
    ``preprocessor_config.json`` nor transformers 5's ``processor_config.json``). One that the
    checkpoint declares but that cannot be built is a CheckpointError naming the file and the cause."""
    import transformers

    source = resolve_source(path_or_repo_id)
    declared = [source.directory / name for name in PROCESSOR_FILES if (source.directory / name).exists()]
    if source.gguf_file is not None or not declared:
        return None
    for path in declared:
        _check_json(path)
    try:
        processor = from_checkpoint(transformers.AutoProcessor, source)
    except CheckpointError:
        raise
    except Exception as exc:  # transformers and its image processors raise their own types
        raise CheckpointError(f"{declared[0]}: the checkpoint's processor cannot be built: {exc}") from exc
    return processor if hasattr(processor, "image_processor") else None


def chat_template_error(renderer, path_or_repo_id=None) -> str | None:
    """Why ``renderer`` (a tokenizer or processor) cannot render chats: its chat template does not
    compile (named by the checkpoint's file that holds it, and jinja's error), or jinja2 is older than
    transformers takes. None when the template compiles, or there is none. Checked at load, where
    transformers compiles a template only when it first renders one."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = getattr(renderer, "chat_template", None)
    if isinstance(template, dict):  # named templates: a chat renders the default one
        template = template.get("default")
    if not template:
        return None
    try:
        _compile_jinja_template(template)
    except ImportError as exc:  # a jinja2 older than transformers takes renders no template
        return str(exc)
    except TemplateError as exc:
        where = _chat_template_origin(renderer, template, path_or_repo_id)
        return f"{where}: the chat template does not compile (line {exc.lineno}: {exc})"
    return None


# Where a checkpoint keeps its chat template: a file of its own, or a JSON file's "chat_template" field.
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json", "chat_template.json", "processor_config.json")


def _chat_template_origin(renderer, template: str, path_or_repo_id) -> str:
    """The checkpoint's file that holds ``template``, or its GGUF metadata; the renderer's attribute
    when none does (a tokenizer or processor not loaded from the checkpoint)."""
    if path_or_repo_id is not None:
        source = resolve_source(path_or_repo_id)
        for name in CHAT_TEMPLATE_FILES:
            path = source.directory / name
            if not path.is_file():
                continue
            if path.suffix == ".jinja":
                held = [path.read_text()]
            else:  # one template, or a list of named ones
                field = json.loads(path.read_text()).get("chat_template")
                held = [entry["template"] for entry in field] if isinstance(field, list) else [field]
            if template in held:
                return str(path)
        if source.gguf_file is not None and read_gguf(source.path).metadata.get("tokenizer.chat_template") == template:
            return f"{source.path} (its tokenizer.chat_template metadata)"
    return f"{type(renderer).__name__}.chat_template"


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
