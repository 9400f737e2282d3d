"""Checkpoint formats -> zoo models: HF safetensors directories (single or sharded), GGUF files,
hub repo ids; the config loading; the layer-by-layer diff against HuggingFace."""

from loaders.checkpoint import CheckpointError, Source, TensorRef, open_checkpoint, resolve_source
from loaders.config import load_config, load_tokenizer
from loaders.load import load_model

__all__ = ["CheckpointError", "Source", "TensorRef", "load_config", "load_tokenizer", "load_model", "open_checkpoint", "resolve_source"]
