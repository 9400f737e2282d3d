"""Gemma 2: Gemma's RMSNorm and embedding scaling in a block with a norm before and after each
branch; attention scaled by ``query_pre_attn_scalar**-0.5`` with soft-capped scores, sliding window
on the layers ``config.layer_types`` says; the final logits soft-capped too.

    x -> RMSNorm -> attn -> RMSNorm -> + x -> RMSNorm -> MLP -> RMSNorm -> +
"""

from layers import Attention, GatedMLP
from models.auto import register
from models.base import CausalLM, DecoderLayer, NormSlots, attention_shape, layer_types_window
from models.modeling_gemma import GemmaRMSNorm


class Gemma2Attention(Attention):
    def __init__(self, config, layer_idx: int, **options):
        bias = config.attention_bias
        super().__init__(
            **attention_shape(config, layer_types_window(config, layer_idx)), qkv_bias=bias, o_bias=bias,
            scale=config.query_pre_attn_scalar**-0.5, logit_softcap=config.attn_logit_softcapping, **options,
        )


class Gemma2MLP(GatedMLP):
    def __init__(self, config):
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_activation)


class Gemma2DecoderLayer(DecoderLayer):
    norms = NormSlots(
        pre_attention="input_layernorm", post_attention="post_attention_layernorm",
        pre_mlp="pre_feedforward_layernorm", post_mlp="post_feedforward_layernorm",
    )
    norm_layer = GemmaRMSNorm

    def __init__(self, config, layer_idx: int):
        super().__init__(config, Gemma2Attention(config, layer_idx), Gemma2MLP(config))


@register("Gemma2ForCausalLM")
class Gemma2ForCausalLM(CausalLM):
    decoder_layer = Gemma2DecoderLayer
    scale_embeddings = True
