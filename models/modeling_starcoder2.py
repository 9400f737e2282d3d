"""Starcoder2: Llama's pre-norm block with LayerNorm (weight and bias) for every norm, a bias on every
projection (``use_bias``), an ungated MLP and ``config.sliding_window`` on every layer.

    x -> LayerNorm -> GQA self-attention with rotary -> + x -> LayerNorm -> c_proj(act(c_fc(.))) -> +
"""

from layers import Attention, LayerNorm, UngatedMLP
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape


class Starcoder2Attention(Attention):
    def __init__(self, config):
        bias = config.use_bias
        super().__init__(**attention_shape(config, config.sliding_window), qkv_bias=bias, o_bias=bias)


class Starcoder2MLP(UngatedMLP):
    up_name, down_name = "c_fc", "c_proj"

    def __init__(self, config):
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_act, bias=config.use_bias)


class Starcoder2DecoderLayer(DecoderLayer):
    norm_layer = LayerNorm
    norm_eps_field = "norm_epsilon"

    def __init__(self, config, layer_idx: int):
        super().__init__(config, Starcoder2Attention(config), Starcoder2MLP(config))


@register("Starcoder2ForCausalLM")
class Starcoder2ForCausalLM(CausalLM):
    decoder_layer = Starcoder2DecoderLayer
