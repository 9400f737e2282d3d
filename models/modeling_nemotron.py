"""Nemotron (NVIDIA Minitron-4B-Base, Minitron-8B-Base, Nemotron-Mini-4B-Instruct): Llama's pre-norm
block with LayerNorm1P for every norm (a LayerNorm with bias whose weight is stored as an offset from
one; the config's ``norm_eps``), Arcee's ungated MLP with ReLU squared (``hidden_act`` "relu2"), and
rotary on the first ``partial_rotary_factor`` of each head's channels (half by default), on the halves
of those channels as Llama's; a bias on q, k, v and o where ``attention_bias``, on the MLP's
projections where ``mlp_bias``.

    x -> LayerNorm1P -> GQA self-attention with partial rotary -> + x -> LayerNorm1P -> down(relu(up(.))^2) -> +
"""

from functools import partial

from layers import LayerNorm
from models.auto import register
from models.base import CausalLM, DecoderLayer
from models.modeling_arcee import ArceeMLP
from models.modeling_llama import LlamaAttention

NemotronLayerNorm1P = partial(LayerNorm, weight_offset=1.0)


class NemotronDecoderLayer(DecoderLayer):
    norm_layer = NemotronLayerNorm1P
    norm_eps_field = "norm_eps"

    def __init__(self, config, layer_idx: int):
        super().__init__(config, LlamaAttention(config), ArceeMLP(config))


@register("NemotronForCausalLM")
class NemotronForCausalLM(CausalLM):
    decoder_layer = NemotronDecoderLayer
    partial_rotary = True
