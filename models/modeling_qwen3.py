"""Qwen3: Llama with a per-head RMSNorm on queries and keys before rotary."""

from layers import Attention
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape, layer_types_window
from models.modeling_llama import LlamaMLP


class Qwen3Attention(Attention):
    def __init__(self, config, sliding_window: int | None):
        bias = config.attention_bias
        super().__init__(
            **attention_shape(config, sliding_window), qkv_bias=bias, o_bias=bias, qk_norm_eps=config.rms_norm_eps
        )


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, Qwen3Attention(config, layer_types_window(config, layer_idx)), LlamaMLP(config))


@register("Qwen3ForCausalLM")
class Qwen3ForCausalLM(CausalLM):
    decoder_layer = Qwen3DecoderLayer
