"""Gemma 3's language model (``Gemma3ForCausalLM``: Gemma 3 1B, and the text of the larger ones
saved alone): Gemma 2's block, norms and scaled embeddings, with Gemma's RMSNorm on each head of q
and k, no soft-capping where the config sets none (Gemma 3's), a sliding window on the layers
``config.layer_types`` marks (five of every six), and rope settings of their own for the sliding
and the full layers (bases 10,000 and 1,000,000; linear scaling on the full ones of the larger models).

    x -> RMSNorm -> attn (q/k RMSNorm per head) -> RMSNorm -> + x -> RMSNorm -> MLP -> RMSNorm -> +
"""

from layers import Attention
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape, layer_types_window
from models.modeling_gemma import GemmaRMSNorm, refuse_bidirectional
from models.modeling_gemma2 import Gemma2DecoderLayer, Gemma2MLP


class Gemma3Attention(Attention):
    def __init__(self, config, layer_idx: int):
        bias = config.attention_bias
        super().__init__(
            **attention_shape(config, layer_types_window(config, layer_idx)), qkv_bias=bias, o_bias=bias,
            scale=config.query_pre_attn_scalar**-0.5, logit_softcap=config.attn_logit_softcapping,
            qk_norm_eps=config.rms_norm_eps, rms_norm=GemmaRMSNorm,
        )


class Gemma3DecoderLayer(DecoderLayer):
    norms = Gemma2DecoderLayer.norms
    norm_layer = GemmaRMSNorm

    def __init__(self, config, layer_idx: int):
        refuse_bidirectional(config)
        super().__init__(config, Gemma3Attention(config, layer_idx), Gemma2MLP(config))


@register("Gemma3ForCausalLM")
class Gemma3ForCausalLM(CausalLM):
    decoder_layer = Gemma3DecoderLayer
    scale_embeddings = True
