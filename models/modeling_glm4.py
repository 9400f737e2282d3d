"""GLM-4 (GLM-4-9B-0414, GLM-4-32B-0414): a block with an RMSNorm before and after each
branch (HF's names: ``input_layernorm`` and ``post_self_attn_layernorm`` around attention,
``post_attention_layernorm`` and ``post_mlp_layernorm`` around the MLP), a bias on q, k and v where
``attention_bias``, and rotary on the interleaved channel pairs (0, 1), (2, 3), ... of the first
``partial_rotary_factor`` of each head (half in GLM-4's configs).

    x -> RMSNorm -> attn -> RMSNorm -> + x -> RMSNorm -> SiLU-gated MLP -> RMSNorm -> +

GLM (GLM-4-9B-Chat's HF port, ``GlmForCausalLM``): the same attention and MLP in Llama's block of a
norm before each branch only.

    x -> RMSNorm -> attn -> + x -> RMSNorm -> SiLU-gated MLP -> +
"""

from layers import Attention, GatedMLP
from models.auto import register
from models.base import CausalLM, DecoderLayer, NormSlots, attention_shape


class Glm4Attention(Attention):
    def __init__(self, config):
        super().__init__(**attention_shape(config), qkv_bias=config.attention_bias, rope_interleaved=True)


class Glm4MLP(GatedMLP):
    """HF's module holds gate and up as one ``gate_up_proj``, gate's rows first: the fused layer reads it whole."""

    def __init__(self, config):
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_act)


class Glm4DecoderLayer(DecoderLayer):
    norms = NormSlots(
        pre_attention="input_layernorm", post_attention="post_self_attn_layernorm",
        pre_mlp="post_attention_layernorm", post_mlp="post_mlp_layernorm",
    )

    def __init__(self, config, layer_idx: int):
        super().__init__(config, Glm4Attention(config), Glm4MLP(config))


@register("Glm4ForCausalLM")
class Glm4ForCausalLM(CausalLM):
    decoder_layer = Glm4DecoderLayer
    partial_rotary = True


class GlmDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, Glm4Attention(config), Glm4MLP(config))


@register("GlmForCausalLM")
class GlmForCausalLM(CausalLM):
    decoder_layer = GlmDecoderLayer
    partial_rotary = True
