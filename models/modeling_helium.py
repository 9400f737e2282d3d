"""Helium (Kyutai Helium-1 2B): Llama's pre-norm block with RMSNorms that multiply by their weight in
float32 before rounding, rotary on the interleaved channel pairs (0, 1), (2, 3), ... of each head,
rounded in the activations' dtype, a bias on q, k and v where ``attention_bias`` and none on o_proj.

    x -> RMSNorm -> GQA self-attention with interleaved rotary -> + x -> RMSNorm -> SiLU-gated MLP -> +

HF's o_proj maps ``hidden_size`` channels to ``hidden_size``: a config whose heads are not
``hidden_size`` wide in all is refused by name.
"""

from functools import partial

from layers import Attention, RMSNorm
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape
from models.modeling_llama import LlamaMLP


class HeliumAttention(Attention):
    def __init__(self, config):
        shape = attention_shape(config)
        if shape["num_heads"] * shape["head_dim"] != config.hidden_size:
            raise ValueError(f"num_attention_heads * head_dim ({shape['num_heads']} * {shape['head_dim']}) differs "
                             f"from hidden_size ({config.hidden_size}), the width HF's Helium o_proj takes")
        super().__init__(**shape, qkv_bias=config.attention_bias, rope_interleaved=True)


class HeliumDecoderLayer(DecoderLayer):
    norm_layer = partial(RMSNorm, multiply_in_float32=True)

    def __init__(self, config, layer_idx: int):
        super().__init__(config, HeliumAttention(config), LlamaMLP(config))


@register("HeliumForCausalLM")
class HeliumForCausalLM(CausalLM):
    decoder_layer = HeliumDecoderLayer
