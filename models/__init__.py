"""zoo's architectures. Every ``modeling_*.py`` in this folder is imported here, so adding an
architecture means adding its file; its ``@register`` decorator does the rest."""

import importlib
import pkgutil

from models.auto import (
    architecture_of,
    AutoModelForCausalLM,
    UnsupportedArchitectureError,
    model_class_for,
    register,
    supported_architectures,
)
from models.base import CausalLM, DecoderLayer, DecoderModel

for _module in pkgutil.iter_modules(__path__):
    if _module.name.startswith("modeling_"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "AutoModelForCausalLM", "CausalLM", "architecture_of", "DecoderLayer", "DecoderModel", "UnsupportedArchitectureError",
    "model_class_for", "register", "supported_architectures",
]
