"""Gemma: Llama's pre-norm block with RMSNorm weights stored as offsets from one and multiplied in
float32, embeddings scaled by ``sqrt(hidden_size)``, a gelu-tanh gated MLP, tied embeddings."""

from functools import partial

from layers import RMSNorm
from models.auto import register
from models.base import CausalLM, DecoderLayer
from models.modeling_llama import LlamaAttention, LlamaMLP

GemmaRMSNorm = partial(RMSNorm, weight_offset=1.0, multiply_in_float32=True)


def refuse_bidirectional(config) -> None:
    """Gemma's embedding models attend over later tokens too; zoo's decoders attend causally."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True (attention over later tokens too) is not supported")


class GemmaDecoderLayer(DecoderLayer):
    norm_layer = GemmaRMSNorm

    def __init__(self, config, layer_idx: int):
        refuse_bidirectional(config)
        super().__init__(config, LlamaAttention(config), LlamaMLP(config))


@register("GemmaForCausalLM")
class GemmaForCausalLM(CausalLM):
    decoder_layer = GemmaDecoderLayer
    scale_embeddings = True
