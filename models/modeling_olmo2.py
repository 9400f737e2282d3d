"""OLMo 2: Llama's attention and MLP in a block of post-norms only, RMSNorm on q and k over the
whole projection (before splitting into heads), every norm's weight multiply in float32, q and k
rotated by float32 cos and sin and rounded once (HF's OLMo 2 rotary keeps cos and sin in float32).

    x -> attn -> RMSNorm -> + x -> MLP -> RMSNorm -> +
"""

from functools import partial

from layers import Attention, RMSNorm
from models.auto import register
from models.base import CausalLM, DecoderLayer, NormSlots, attention_shape
from models.modeling_llama import LlamaMLP

Olmo2RMSNorm = partial(RMSNorm, multiply_in_float32=True)


class Olmo2Attention(Attention):
    """OLMo 2's reads no window; OLMo 3's the layer's ``sliding_window``."""

    def __init__(self, config, sliding_window: int | None = None):
        bias = config.attention_bias
        super().__init__(
            **attention_shape(config, sliding_window), qkv_bias=bias, o_bias=bias, qk_norm_eps=config.rms_norm_eps,
            qk_norm_per_head=False, qk_norm=Olmo2RMSNorm, rotary_precision="float32_tables",
        )


class Olmo2DecoderLayer(DecoderLayer):
    norms = NormSlots(
        pre_attention=None, post_attention="post_attention_layernorm", pre_mlp=None,
        post_mlp="post_feedforward_layernorm",
    )
    norm_layer = Olmo2RMSNorm

    def __init__(self, config, layer_idx: int):
        super().__init__(config, Olmo2Attention(config), LlamaMLP(config))


@register("Olmo2ForCausalLM")
class Olmo2ForCausalLM(CausalLM):
    decoder_layer = Olmo2DecoderLayer
