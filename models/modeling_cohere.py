"""Cohere (Command R, Command R+, Aya 23): attention and the MLP side by side on one LayerNorm
(no bias, computed in float32), rotary on interleaved channel pairs computed in float32, the logits
multiplied by ``logit_scale``.

    each layer: n = LayerNorm(x); x = x + attention(n) + MLP(n)
                (attention: GQA with rotary on the pairs (0, 1), (2, 3), ...; with ``use_qk_norm``
                 (Command R+), a LayerNorm on each head of q and k with a weight of its own per head)
    logits = lm_head(LayerNorm(x)) * logit_scale

Cohere 2 (Command R7B, Command A): the same block, with rotary and a window of ``sliding_window`` on the
layers ``layer_types`` marks sliding, and neither on the others (no position embedding, full attention).
"""

import operator
from functools import partial

from layers import Attention, GatedMLP, LayerNorm
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape, layer_types_window

CohereLayerNorm = partial(LayerNorm, bias=False)


class CohereAttention(Attention):
    def __init__(self, config):
        bias = config.attention_bias
        super().__init__(
            **attention_shape(config), qkv_bias=bias, o_bias=bias, rope_interleaved=True, rotary_precision="float32",
            qk_norm_eps=config.layer_norm_eps if config.use_qk_norm else None, qk_norm_weight_per_head=True,
            qk_norm=CohereLayerNorm,
        )


class Cohere2Attention(Attention):
    """HF rotates where the layer has a window: on a sliding layer, and nowhere where ``sliding_window`` is null."""

    def __init__(self, config, layer_idx: int):
        bias, window = config.attention_bias, layer_types_window(config, layer_idx)
        super().__init__(
            **attention_shape(config, window), qkv_bias=bias, o_bias=bias, rope_interleaved=True,
            rotary_precision="float32", rotary=window is not None,
        )


class CohereMLP(GatedMLP):
    def __init__(self, config):
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_act)


class CohereDecoderLayer(DecoderLayer):
    norm_layer = CohereLayerNorm
    norm_eps_field = "layer_norm_eps"

    def __init__(self, config, layer_idx: int):
        super().__init__(config, CohereAttention(config), CohereMLP(config), parallel=True)


@register("CohereForCausalLM")
class CohereForCausalLM(CausalLM):
    decoder_layer = CohereDecoderLayer
    logits_scale = ("logit_scale", operator.mul)


class Cohere2DecoderLayer(DecoderLayer):
    norm_layer = CohereLayerNorm
    norm_eps_field = "layer_norm_eps"

    def __init__(self, config, layer_idx: int):
        super().__init__(config, Cohere2Attention(config, layer_idx), CohereMLP(config), parallel=True)


@register("Cohere2ForCausalLM")
class Cohere2ForCausalLM(CohereForCausalLM):
    decoder_layer = Cohere2DecoderLayer
