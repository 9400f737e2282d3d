"""Gemma 3's language model (``Gemma3ForCausalLM``: Gemma 3 1B, and the text of the larger ones
saved alone): Gemma 2's block, norms and scaled embeddings, with Gemma's RMSNorm on each head of q
and k, no soft-capping where the config sets none (Gemma 3's), a sliding window on the layers
``config.layer_types`` marks (five of every six), and rope settings of their own for the sliding
and the full layers (bases 10,000 and 1,000,000; linear scaling on the full ones of the larger models).

    x -> RMSNorm -> attn (q/k RMSNorm per head) -> RMSNorm -> + x -> RMSNorm -> MLP -> RMSNorm -> +
"""

from models.auto import register
from models.base import CausalLM, DecoderLayer
from models.modeling_gemma import GemmaRMSNorm, refuse_bidirectional
from models.modeling_gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2MLP


class Gemma3Attention(Gemma2Attention):
    """Gemma 2's attention with Gemma's RMSNorm on each head of q and k."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx, qk_norm_eps=config.rms_norm_eps, qk_norm=GemmaRMSNorm)


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
