"""dots.llm1 (``Dots1ForCausalLM``): Qwen3's attention (a per-head q/k RMSNorm before rotary, windows on
the layers ``layer_types`` marks sliding) and DeepSeek-V3's mixture of experts on a Llama-style pre-norm
block.

    x -> RMSNorm -> GQA self-attention -> + x -> RMSNorm -> MLP -> +
    MLP: dense on the first ``first_k_dense_replace`` layers, else sigmoid-routed experts (score
    correction bias to choose them, group-limited top-k, ``routed_scaling_factor``) plus ungated
    shared experts.
"""

from models.auto import register
from models.base import CausalLM, DecoderLayer, layer_types_window
from models.modeling_deepseek_v3 import DeepseekV3MoE
from models.modeling_llama import LlamaMLP
from models.modeling_qwen3 import Qwen3Attention


class Dots1DecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        mlp = DeepseekV3MoE(config) if layer_idx >= config.first_k_dense_replace else LlamaMLP(config)
        super().__init__(config, Qwen3Attention(config, layer_types_window(config, layer_idx)), mlp)


@register("Dots1ForCausalLM")
class Dots1ForCausalLM(CausalLM):
    decoder_layer = Dots1DecoderLayer
