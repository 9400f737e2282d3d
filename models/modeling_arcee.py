"""Arcee (AFM-4.5B): Llama's pre-norm block with an ungated MLP, ``down_proj(act(up_proj(x)))``, its
activation ReLU squared (``hidden_act`` "relu2"), a bias on its projections where ``mlp_bias``.

    x -> RMSNorm -> GQA self-attention with rotary -> + x -> RMSNorm -> down(relu(up(.))^2) -> +
"""

from layers import UngatedMLP
from models.auto import register
from models.base import CausalLM, DecoderLayer
from models.modeling_llama import LlamaAttention


class ArceeMLP(UngatedMLP):
    def __init__(self, config):
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_act, bias=config.mlp_bias)


class ArceeDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, LlamaAttention(config), ArceeMLP(config))


@register("ArceeForCausalLM")
class ArceeForCausalLM(CausalLM):
    decoder_layer = ArceeDecoderLayer
