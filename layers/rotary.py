"""Rotary position embeddings: the inverse frequencies of every rope type zoo's models use.

The rope settings are read from the config the way the installed transformers stores them:
``config.rope_parameters`` (transformers 5) or ``config.rope_scaling`` + ``config.rope_theta``
(transformers 4 and hub checkpoints written by it). Each formula follows HuggingFace's
``modeling_rope_utils`` operation for operation, so float32 cos/sin match it bit for bit.
"""

import math

import torch
from torch import nn


def rope_layer_types(config) -> list[str] | None:
    """The layer types whose rope settings ``config.rope_parameters`` holds apart (Gemma 3's sliding
    and full attention layers), or None where one setting serves every layer."""
    rope, layer_types = getattr(config, "rope_parameters", None), getattr(config, "layer_types", None)
    if isinstance(rope, dict) and layer_types and all(isinstance(rope.get(kind), dict) for kind in layer_types):
        return sorted(set(layer_types))
    return None


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The rope settings of every layer, or of the layers of ``layer_type`` (``rope_layer_types``)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(base: float, dim: int, params: dict) -> torch.Tensor:
    inv_freq = _default_inv_freq(base, dim)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_inv_freq(base: float, dim: int, params: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    original_max = params["original_max_position_embeddings"]
    if factor is None:  # DeepSeek-style configs give the ratio implicitly
        factor = max_position_embeddings / original_max

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)

    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, attention_factor


def _longrope_inv_freqs(base: float, dim: int, params: dict,
                        max_position_embeddings: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE's (Phi-3 128k, Phi-3.5, Phi-4-mini) inverse frequencies with its short factors and
    with its long ones, and its attention factor, which both take."""
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:  # Phi-3 configs give the ratio implicitly
        factor = max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim

    def inv_freq(name: str) -> torch.Tensor:
        factors = params.get(name)
        if not (isinstance(factors, (list, tuple)) and len(factors) == dim // 2
                and all(isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f < math.inf
                        for f in factors)):
            raise ValueError(f"rope_parameters.{name} must be {dim // 2} finite positive numbers (one per "
                             f"rotated channel pair of {dim}), got {factors!r}")
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exponents)

    return inv_freq("short_factor"), inv_freq("long_factor"), attention_factor


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


class RotaryEmbedding(nn.Module):
    """Maps token positions [N] to (cos, sin) [N, rotary_dim] in float32, scaled by the rope type's
    attention factor. Computed once per forward and shared by every layer. ``rotary_dim`` is the
    head's, or, for an architecture that reads it (``partial``: Phi-3's, StableLM's, GLM-4's),
    ``int(head_dim * partial_rotary_factor)`` as HF computes it: the first channels of each head
    rotate, the rest pass (the rotary ops take cos and sin narrower than the head). ``layer_type``: the settings of
    those layers, where the config holds them apart (``rope_layer_types``).

    LongRoPE has two sets of frequencies. HF picks one per forward: the long set where the
    forward's last position passes ``original_max_position_embeddings``, else the short. A paged
    cache keeps keys across forwards, and under HF's rule a sequence that grows past that length
    would hold keys of both sets (and a prefix shared between sequences, the set of whichever
    computed it). The runtime therefore fixes the set of the forwards through its cache once
    (``fix_context``): the long one where its sequences may pass the original context, the short
    one, HF's for every such sequence, where they may not. A cache-free forward, and one through a
    cache with no set fixed, picks as HF does."""

    def __init__(self, config, head_dim: int, partial: bool = False, layer_type: str | None = None):
        super().__init__()
        params = rope_parameters(config, layer_type)
        self.rope_type = params["rope_type"]
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; supported: {list(ROPE_TYPES)}")
        factor = params.get("partial_rotary_factor", 1.0)
        if factor != 1.0 and not partial:
            # HF's model of such an architecture rotates the whole head, or fails, whatever the field says.
            raise ValueError(f"partial_rotary_factor {factor!r}: this architecture rotates the whole head "
                             "(HF's model of it does not read the field)")
        rotary_dim = int(head_dim * factor)
        if not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
            raise ValueError(f"partial_rotary_factor {factor!r} of head_dim {head_dim} rotates {rotary_dim} "
                             "channels: zoo takes an even number, at most the head's")
        if self.rope_type in ("llama3", "yarn", "longrope"):
            params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
        self.params = params
        self.base = float(params["rope_theta"])
        self.dim = rotary_dim
        self.max_position_embeddings = config.max_position_embeddings
        self.attention_scaling = 1.0
        self.long_context: bool | None = None  # LongRoPE's set, once fixed (``fix_context``)

        # Built on the CPU even when the model is constructed on the meta device: this buffer
        # is computed, not loaded.
        with torch.device("cpu"):
            if self.rope_type == "llama3":
                inv_freq = _llama3_inv_freq(self.base, rotary_dim, params)
            elif self.rope_type == "yarn":
                inv_freq, self.attention_scaling = _yarn_inv_freq(
                    self.base, rotary_dim, params, config.max_position_embeddings
                )
            elif self.rope_type == "longrope":
                inv_freq, long_inv_freq, self.attention_scaling = _longrope_inv_freqs(
                    self.base, rotary_dim, params, config.max_position_embeddings
                )
                self.register_buffer("long_channel_inv_freq", torch.cat((long_inv_freq, long_inv_freq)),
                                     persistent=False)
            else:
                inv_freq = _default_inv_freq(self.base, rotary_dim)
                if self.rope_type == "linear":
                    inv_freq = inv_freq / params["factor"]
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # The rate of each of the head's channels: inv_freq over both halves, as HF's cat((freqs, freqs)).
        self.register_buffer("channel_inv_freq", torch.cat((inv_freq, inv_freq)), persistent=False)

    def fix_context(self, max_positions: int) -> None:
        """Fix LongRoPE's set for the forwards through the KV cache, whose tokens lie within the first
        ``max_positions`` positions: the long one iff that passes the original context. Other rope
        types have one set."""
        if self.rope_type == "longrope":
            self.long_context = max_positions > self.params["original_max_position_embeddings"]

    @property
    def reads_positions_on_host(self) -> bool:
        """Whether a forward picks its frequencies from the positions' values (dynamic NTK, and
        LongRoPE before ``fix_context``): it waits for them, so it cannot be captured."""
        return self.rope_type == "dynamic" or (self.rope_type == "longrope" and self.long_context is None)

    def _long_factors(self, positions: torch.Tensor, through_cache: bool) -> bool:
        if through_cache and self.long_context is not None:
            return self.long_context
        return bool(positions.max() + 1 > self.params["original_max_position_embeddings"])

    def _dynamic_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        # Dynamic NTK stretches the base once the sequence outgrows the trained context.
        seq_len = positions.max() + 1
        if seq_len <= self.max_position_embeddings:
            return self.inv_freq
        factor, dim = self.params["factor"], self.dim
        base = self.base * ((factor * seq_len / self.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim
        return 1.0 / (base**exponents)

    def forward(self, positions: torch.Tensor, through_cache: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of ``positions``; ``through_cache``: the forward keeps its keys in the KV cache
        (LongRoPE's fixed set applies)."""
        if self.rope_type == "dynamic":
            inv_freq = self._dynamic_inv_freq(positions)
            channel_inv_freq = torch.cat((inv_freq, inv_freq))
        elif self.rope_type == "longrope" and self._long_factors(positions, through_cache):
            channel_inv_freq = self.long_channel_inv_freq
        else:
            channel_inv_freq = self.channel_inv_freq
        # HF's float(position) * inv_freq, concatenated with itself, as one product: the integer
        # positions are cast to float32 inside it (three kernels a step with cos and sin).
        emb = positions[:, None] * channel_inv_freq.float().to(positions.device)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos, sin
