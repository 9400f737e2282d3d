"""Checkpoint formats: HF safetensors directories (single or sharded, FP8 block-quantised ones
dequantised on load or kept in FP8), GGUF files, hub repo ids, state dicts in memory; their configs, tokenizers
and processors; the loader that fills a model built on the meta device from its declarations.
Nothing here imports ``models``."""

from loaders.checkpoint import open_checkpoint, resolve_source
from loaders.config import (chat_template_error, from_checkpoint, load_config, load_generation_config, load_processor,
                             load_tokenizer)
from loaders.default_model import default_model_path
from loaders.in_memory import copy_weights
from loaders.load import load_weights
from loaders.types import CheckpointError, HostMemoryError, NonFiniteWeightWarning, Source, TensorRef

__all__ = [
    "CheckpointError", "HostMemoryError", "NonFiniteWeightWarning", "Source", "TensorRef", "chat_template_error",
    "copy_weights", "default_model_path", "from_checkpoint", "load_config", "load_generation_config", "load_processor",
    "load_tokenizer", "load_weights",
    "open_checkpoint", "resolve_source",
]
