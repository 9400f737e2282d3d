"""The architecture registry and ``AutoModelForCausalLM``: it picks the class for a config, builds
the model on the meta device and hands it to a loader of ``loaders``, which reads the model's
loading declarations off the object."""

import math

import torch
from torch import nn

import layers
from loaders import CheckpointError, TensorRef, copy_weights, load_config, load_weights, open_checkpoint, resolve_source
from loaders.load import tensor_shapes
from models.base import split_loaded_norms

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
    architectures = getattr(config, "architectures", None)
    if architectures is not None and not (
        isinstance(architectures, (list, tuple)) and all(isinstance(name, str) for name in architectures)
    ):
        raise ValueError(f"config field 'architectures' must be a list of class names, got {architectures!r}")
    if architectures:
        return architectures[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, f"<model_type {config.model_type}>")


def model_class_for(config, source: str = "checkpoint") -> type:
    name = architecture_of(config)
    if name not in _REGISTRY:
        raise UnsupportedArchitectureError(
            f"{source}: architecture {name!r} is not supported by zoo; supported: {', '.join(supported_architectures())}"
        )
    return _REGISTRY[name]


def model_dtype(dtype) -> torch.dtype:
    """A torch floating dtype, given as one or by its name."""
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch dtype or its name (float32, bfloat16, float16), "
                         f"got {dtype!r}")
    return resolved


def model_device(device) -> torch.device:
    """A torch device that this torch can compute on, given as one or by its name."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a device torch knows: {exc}") from None
    if device.type == "meta":  # tensors of shapes only: a model there loads, and its first forward fails
        raise ValueError("device 'meta' holds no values: a model cannot compute on it; give cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} asked for, but this torch sees no CUDA device")
    return device


def check_load_flags(keep_fp8: bool | None = None, mmap: bool = True, keep_mxfp4: bool | None = None) -> None:
    """A TypeError naming the loading flag of another type: keep_fp8 and keep_mxfp4 take None, True or
    False, mmap True or False (``from_pretrained``'s options, which ``LLM`` checks before ranks start)."""
    for name, value, optional in (("keep_fp8", keep_fp8, True), ("keep_mxfp4", keep_mxfp4, True),
                                  ("mmap", mmap, False)):
        if not (isinstance(value, bool) or (optional and value is None)):
            raise TypeError(f"{name} must be {'None, ' if optional else ''}True or False, got {value!r}")


def checkpoint_dtype(config) -> torch.dtype:
    """What ``dtype="auto"`` means (as in HuggingFace): the floating dtype the config records for
    its checkpoint, else float32 (GGUF files record none)."""
    # transformers reads a config.json's ``torch_dtype`` (transformers 4's name) into ``dtype`` too,
    # as a torch dtype where it names one.
    recorded = config.dtype
    return recorded if isinstance(recorded, torch.dtype) and recorded.is_floating_point else torch.float32


# The config fields that size a model (its tensors, the tables built with it, its cache) and the
# counts it divides by (every decoder_sparse_step-th layer sparse, experts in n_group groups, images in
# patch_size patches): each, where a config has it, is a positive integer. A count of layers is at most
# the checkpoint's tensor count; every other size at most its element count, so a damaged field fails
# before anything is allocated.
SIZE_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "max_position_embeddings", "num_hidden_layers", "moe_intermediate_size", "shared_expert_intermediate_size",
    "num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
    "decoder_sparse_step", "n_group", "topk_group", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim", "image_size", "patch_size", "num_channels",
)
UNBOUNDED_FIELDS = ("max_position_embeddings",)  # sizes the KV cache, which the engine's budget bounds
# Sizes whose 0 means the part is absent (GraniteMoeShared's shared MLP): non-negative integers, bounded
# as the other sizes are.
OPTIONAL_SIZE_FIELDS = ("shared_intermediate_size",)
# The config fields of numbers the layers compute with: each, where a config has it (null: a soft-cap
# that caps nothing), a finite positive number. At zero or below, a norm's epsilon or a rope base or
# factor makes NaN or Inf, a soft-cap divides by zero, Gemma 2's score scale (a square root) is complex,
# DeepSeek's routing scale silences or inverts the routed experts, Granite's multipliers the input,
# the scores or the branches (its logits_scaling divides by zero), Cohere's logit_scale the logits, and
# OLMoE's clip_qkv (null: no clamp) makes every value of q, k and v the same number.
POSITIVE_FIELDS = ("rms_norm_eps", "layer_norm_eps", "norm_epsilon", "norm_eps", "query_pre_attn_scalar",
                   "attn_logit_softcapping", "final_logit_softcapping", "routed_scaling_factor",
                   "embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling",
                   "logit_scale", "clip_qkv")
# The same of the rope settings that layers/rotary.py reads (``layers.rope_parameters``); YaRN's betas
# and mscales at zero mean their defaults, so they are finite and non-negative.
POSITIVE_ROPE_FIELDS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings", "attention_factor", "partial_rotary_factor")
NON_NEGATIVE_ROPE_FIELDS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def validate_config(config, checkpoint: dict[str, TensorRef], origin: str) -> None:
    """Raise a CheckpointError naming the first config field, of the config or a sub-config, that
    cannot build a model of this checkpoint: a size not a positive integer or larger than the
    checkpoint could hold, or a number a layer computes with that is not finite and positive."""
    elements = sum(math.prod(ref.shape) for ref in checkpoint.values())
    for prefix, sub in _named_configs(config):
        _check_sizes(sub, prefix, len(checkpoint), elements, origin)
        for field in POSITIVE_FIELDS:
            _check_number(getattr(sub, field, None), prefix + field, origin)
        kinds = [None]
        if layers.rope_layer_types(sub) is not None:  # settings per layer type (Gemma 3): each one it holds
            kinds = [kind for kind, rope in sub.rope_parameters.items() if isinstance(rope, dict)]
        for layer_type in kinds:
            rope = layers.rope_parameters(sub, layer_type)
            where = f"{prefix}rope_parameters." + (f"{layer_type}." if layer_type else "")
            for field in POSITIVE_ROPE_FIELDS + NON_NEGATIVE_ROPE_FIELDS:
                _check_number(rope.get(field), where + field, origin, zero_allowed=field in NON_NEGATIVE_ROPE_FIELDS)


def _named_configs(config, prefix: str = ""):
    """(prefix, config) for the config and each of its sub-configs (LLaVA's text_config and
    vision_config), the prefix naming their fields in errors."""
    yield prefix, config
    for name in config.sub_configs:
        if (sub := getattr(config, name, None)) is not None:
            yield from _named_configs(sub, f"{prefix}{name}.")


def _check_sizes(config, prefix: str, tensors: int, elements: int, origin: str) -> None:
    for field in SIZE_FIELDS + OPTIONAL_SIZE_FIELDS:
        value = getattr(config, field, None)
        if value is None:
            continue
        optional = field in OPTIONAL_SIZE_FIELDS
        if not (isinstance(value, int) and not isinstance(value, bool) and (value > 0 or optional and value == 0)):
            kind = "non-negative" if optional else "positive"
            raise CheckpointError(f"{origin}: config field {prefix + field!r} must be a {kind} integer, "
                                  f"got {value!r}")
        limit, what = (tensors, "tensors") if field == "num_hidden_layers" else (elements, "elements")
        if field not in UNBOUNDED_FIELDS and value > limit:
            raise CheckpointError(f"{origin}: config field {prefix + field!r} is {value}, more than the checkpoint's "
                                  f"{limit} {what} can hold")
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if heads and kv_heads and heads % kv_heads:
        raise CheckpointError(f"{origin}: config field {prefix + 'num_attention_heads'!r} ({heads}) is not a "
                              f"multiple of {prefix + 'num_key_value_heads'!r} ({kv_heads})")


def _check_number(value, field: str, origin: str, zero_allowed: bool = False) -> None:
    """None passes: the field is absent."""
    if value is None:
        return
    finite = isinstance(value, (int, float)) and not isinstance(value, bool) and -math.inf < value < math.inf
    if not (finite and (value > 0 or zero_allowed and value == 0)):
        kind = "non-negative" if zero_allowed else "positive"
        raise CheckpointError(f"{origin}: config field {field!r} must be a finite {kind} number, got {value!r}")


def _build_on_meta(config, source: str, tensor_parallel=None,
                   expert_parallel: bool | None = None) -> tuple[nn.Module, dict[str, tuple[int, ...]] | None]:
    """The model on the meta device, split for the rank where ``tensor_parallel``; and then the
    shapes of the whole tensors its ranks read parts of (``loaders.load.tensor_shapes``)."""
    model_class = model_class_for(config, source)
    with torch.device("meta"):
        try:
            model = model_class(config)
        except (ValueError, ArithmeticError) as exc:  # a config value no layer takes (hidden_act, rope_type, a zero)
            raise CheckpointError(f"{source}: {exc}") from exc
        if tensor_parallel is None:
            return model, None
        whole_shapes = tensor_shapes(model)
        return layers.tensor_parallel(model, tensor_parallel, expert_parallel), whole_shapes


class AutoModelForCausalLM:
    @staticmethod
    def from_pretrained(path_or_repo_id, dtype: torch.dtype | str = torch.float32, device="cpu",
                        keep_fp8: bool | None = None, mmap: bool = True, tensor_parallel=None,
                        expert_parallel: bool | None = None, keep_mxfp4: bool | None = None):
        """Load a causal LM from a local HF directory, a ``.gguf`` file or a hub repo id, in ``dtype``
        (a floating-point torch dtype or its name; ``"auto"``: the checkpoint's, see
        ``checkpoint_dtype``) on ``device``. The linear weights of an FP8 block-quantised checkpoint
        stay in FP8 when ``keep_fp8`` (None: on CUDA devices of sm89 onward), else they are dequantised
        to ``dtype``; MXFP4 experts (gpt-oss's) stay in MXFP4 when ``keep_mxfp4`` (None: on CUDA devices),
        in about a quarter of their bfloat16 bytes (gpt-oss-120b then fits one 80 GB GPU; decode faster,
        prompts slower: docs/performance.md). On the CPU, a safetensors tensor already in ``dtype`` that a
        layer takes whole (embeddings, norms; ``loaders.load.keepable``) maps its file instead of being copied:
        truncating or rewriting the file in place while the model lives ends the process (SIGBUS);
        ``mmap=False`` copies every tensor. A tensor with NaN or Inf values is named in a
        ``loaders.NonFiniteWeightWarning``. ``tensor_parallel``: a ``torch.distributed`` process group
        to split the model over (every rank of it calls this); this process builds and loads its
        rank's slice of each layer (``layers.tensor_parallel``) and returns the whole model's logits.
        ``expert_parallel``, with ``tensor_parallel``: each rank holds whole experts (True) or every
        expert's slice (False); None: whole experts where the ranks divide the number of experts."""
        check_load_flags(keep_fp8, mmap, keep_mxfp4)
        if tensor_parallel is not None and not isinstance(tensor_parallel, torch.distributed.ProcessGroup):
            raise TypeError(f"tensor_parallel must be a torch.distributed process group (every rank of it calls "
                            f"from_pretrained), got {tensor_parallel!r}; LLM(..., tensor_parallel_size=N) starts the ranks")
        if expert_parallel is not None and tensor_parallel is None:
            raise ValueError("expert_parallel says how tensor_parallel's ranks split the experts: give tensor_parallel too")
        dtype = None if dtype == "auto" else model_dtype(dtype)
        device = model_device(device)
        source = resolve_source(path_or_repo_id)
        config = load_config(source)
        model_class_for(config, str(source.path))
        checkpoint = open_checkpoint(source, config)
        validate_config(config, checkpoint, str(source.path))
        model, whole_shapes = _build_on_meta(config, str(source.path), tensor_parallel, expert_parallel)
        model = load_weights(model, checkpoint, dtype or checkpoint_dtype(config), device, keep_fp8, mmap,
                             whole_shapes, keep_mxfp4)
        split_loaded_norms(model)  # FP8 and MXFP4 weights decide it, known only now
        return model

    @staticmethod
    def from_hf(reference: nn.Module, device=None):
        """zoo's model of a HuggingFace model in memory, holding a copy of its weights in their
        dtype, on their device or on ``device`` (a model in host memory copied to a GPU that would
        not hold both)."""
        first = next(reference.parameters())
        name = type(reference).__name__
        model, _ = _build_on_meta(reference.config, name)
        device = first.device if device is None else model_device(device)
        return copy_weights(model, reference.state_dict(), first.dtype, device, origin=f"<{name} in memory>")
