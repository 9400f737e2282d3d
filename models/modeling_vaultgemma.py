"""VaultGemma (Google's VaultGemma 1B, trained with differential privacy): Gemma 2's attention (scores
scaled by ``query_pre_attn_scalar**-0.5`` and soft-capped, a window on the layers ``config.layer_types``
marks), MLP, RMSNorm and embedding scaling, and its final-logit soft-capping, in a block of a norm before
each branch only: Gemma 2's ``input_layernorm`` and ``pre_feedforward_layernorm``, without the norms
after them.

    x -> RMSNorm -> attn -> + x -> RMSNorm -> MLP -> +
"""

from models.auto import register
from models.base import CausalLM, DecoderLayer, NormSlots
from models.modeling_gemma import GemmaRMSNorm
from models.modeling_gemma2 import Gemma2Attention, Gemma2MLP


class VaultGemmaDecoderLayer(DecoderLayer):
    norms = NormSlots(pre_attention="input_layernorm", pre_mlp="pre_feedforward_layernorm")
    norm_layer = GemmaRMSNorm

    def __init__(self, config, layer_idx: int):
        super().__init__(config, Gemma2Attention(config, layer_idx), Gemma2MLP(config))


@register("VaultGemmaForCausalLM")
class VaultGemmaForCausalLM(CausalLM):
    decoder_layer = VaultGemmaDecoderLayer
    scale_embeddings = True
