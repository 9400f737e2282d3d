"""The architecture registry and ``AutoModelForCausalLM``."""

import torch

_REGISTRY: dict[str, type] = {}


class UnsupportedArchitectureError(ValueError):
    pass


def register(*architectures: str):
    """Class decorator: serve the HuggingFace architecture names (``config.architectures[0]``)."""

    def wrap(cls):
        for name in architectures:
            if name in _REGISTRY:
                raise ValueError(f"architecture {name} registered twice: {_REGISTRY[name].__name__} and {cls.__name__}")
            _REGISTRY[name] = cls
        return cls

    return wrap


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def architecture_of(config) -> str:
    """``config.architectures[0]``; configs built from GGUF metadata carry only a model_type."""
    if getattr(config, "architectures", None):
        return config.architectures[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, f"<model_type {config.model_type}>")


def model_class_for(config, source: str = "checkpoint") -> type:
    name = architecture_of(config)
    if name not in _REGISTRY:
        raise UnsupportedArchitectureError(
            f"{source}: architecture {name!r} is not supported by zoo; supported: {', '.join(supported_architectures())}"
        )
    return _REGISTRY[name]


class AutoModelForCausalLM:
    @staticmethod
    def from_pretrained(path_or_repo_id, dtype: torch.dtype | str = torch.float32, device="cpu"):
        """Load a causal LM from a local HF directory, a ``.gguf`` file or a hub repo id, in ``dtype``
        (a floating-point torch dtype or its name) on ``device``."""
        from loaders import load_model

        return load_model(path_or_repo_id, dtype=dtype, device=device)
