"""OLMo (AI2's OLMo 1B, 7B and OLMo 1.7 7B, as HF's ``OlmoForCausalLM``): Llama's pre-norm block with
every norm a LayerNorm without weight or bias, its epsilon fixed at 1e-5 (HF's ``OlmoLayerNorm`` reads no
config field), computed on a float32 copy and rounded once; q, k and v clamped to ``[-clip_qkv,
clip_qkv]`` after their projections where the config sets ``clip_qkv`` (OLMo 1.7's 8); q and k rotated
by float32 cos and sin and rounded once (HF's OLMo rotary keeps cos and sin in float32).

    x -> LayerNorm -> GQA self-attention (q, k, v clamped; rotary) -> + x -> LayerNorm -> SiLU-gated MLP -> +
"""

from functools import partial

from layers import Attention, LayerNorm
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape
from models.modeling_llama import LlamaMLP


class OlmoAttention(Attention):
    def __init__(self, config):
        bias = config.attention_bias
        super().__init__(**attention_shape(config), qkv_bias=bias, o_bias=bias, clip_qkv=config.clip_qkv,
                         rotary_precision="float32_tables")


class OlmoDecoderLayer(DecoderLayer):
    norm_layer = partial(LayerNorm, elementwise_affine=False)
    norm_eps = 1e-5

    def __init__(self, config, layer_idx: int):
        super().__init__(config, OlmoAttention(config), LlamaMLP(config))


@register("OlmoForCausalLM")
class OlmoForCausalLM(CausalLM):
    decoder_layer = OlmoDecoderLayer
