"""Granite (IBM's Granite 3): Llama with four multipliers from the config.

    x = embeddings * embedding_multiplier
    each layer: h = x + residual_multiplier * attention(RMSNorm(x)), its scores scaled by attention_multiplier
                x = h + residual_multiplier * MLP(RMSNorm(h))
    logits = lm_head(RMSNorm(x)) / logits_scaling
"""

import operator

from layers import Attention
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape
from models.modeling_llama import LlamaMLP


class GraniteAttention(Attention):
    """Llama attention whose scores are scaled by ``attention_multiplier`` instead of ``head_dim**-0.5``."""

    def __init__(self, config):
        bias = config.attention_bias
        super().__init__(**attention_shape(config), qkv_bias=bias, o_bias=bias, scale=config.attention_multiplier)


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, GraniteAttention(config), LlamaMLP(config), branch_scale=config.residual_multiplier)


@register("GraniteForCausalLM")
class GraniteForCausalLM(CausalLM):
    decoder_layer = GraniteDecoderLayer
    input_multiplier_field = "embedding_multiplier"
    logits_scale = ("logits_scaling", operator.truediv)
