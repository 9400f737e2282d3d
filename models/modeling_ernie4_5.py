"""ERNIE 4.5, dense (Baidu's ERNIE-4.5-0.3B): Llama's block with rotary on the interleaved channel pairs
(0, 1), (2, 3), ... of each head, by float32 cos and sin in float32 and rounded once (HF's ERNIE 4.5
keeps its tables in float32, as OLMo 2's does), a bias on every projection of attention and the MLP
where ``use_bias``, tied embeddings by default.

    x -> RMSNorm -> GQA self-attention, interleaved rotary in float32 -> + x -> RMSNorm -> SiLU-gated MLP -> +
"""

from layers import Attention, GatedMLP
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape


class Ernie4_5Attention(Attention):
    def __init__(self, config):
        bias = config.use_bias
        super().__init__(**attention_shape(config), qkv_bias=bias, o_bias=bias, rope_interleaved=True,
                         rotary_precision="float32_tables")


class Ernie4_5MLP(GatedMLP):
    def __init__(self, config):
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_act, bias=config.use_bias)


class Ernie4_5DecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, Ernie4_5Attention(config), Ernie4_5MLP(config))


@register("Ernie4_5ForCausalLM")
class Ernie4_5ForCausalLM(CausalLM):
    decoder_layer = Ernie4_5DecoderLayer
