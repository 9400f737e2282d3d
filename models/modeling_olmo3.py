"""OLMo 3 (Olmo 3 7B and 32B, their Instruct and Think models): OLMo 2's block (post-norms only, RMSNorm
on q and k over the whole projection, every norm's weight multiply in float32, q and k rotated in
float32) with a sliding window on the layers ``config.layer_types`` marks (three of every four), and
rope settings of their own for the sliding and the full layers (YaRN on the full ones only, where a
checkpoint's ``rope_scaling`` asks for it).

    x -> attn (windowed on sliding layers) -> RMSNorm -> + x -> MLP -> RMSNorm -> +
"""

from models.auto import register
from models.base import CausalLM, DecoderLayer, layer_types_window
from models.modeling_llama import LlamaMLP
from models.modeling_olmo2 import Olmo2Attention, Olmo2DecoderLayer, Olmo2RMSNorm


class Olmo3DecoderLayer(DecoderLayer):
    norms = Olmo2DecoderLayer.norms
    norm_layer = Olmo2RMSNorm

    def __init__(self, config, layer_idx: int):
        attention = Olmo2Attention(config, layer_types_window(config, layer_idx))
        super().__init__(config, attention, LlamaMLP(config))


@register("Olmo3ForCausalLM")
class Olmo3ForCausalLM(CausalLM):
    decoder_layer = Olmo3DecoderLayer
