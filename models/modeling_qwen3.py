"""Qwen3: Llama with a per-head RMSNorm on queries and keys before rotary."""

from layers import Attention
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape
from models.modeling_llama import LlamaMLP


class Qwen3Attention(Attention):
    def __init__(self, config, layer_idx: int):
        bias = config.attention_bias
        super().__init__(
            **attention_shape(config, layer_idx), qkv_bias=bias, o_bias=bias, qk_norm_eps=config.rms_norm_eps
        )


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, Qwen3Attention(config, layer_idx), LlamaMLP(config))


@register("Qwen3ForCausalLM")
class Qwen3ForCausalLM(CausalLM):
    decoder_layer = Qwen3DecoderLayer
