"""StableLM (StableLM 2 1.6B, StableLM 3B-4E1T, their chat models): Llama's pre-norm block with
LayerNorm (weight and bias) for every norm, a bias on q, k and v where ``use_qkv_bias``, and rotary
on the first ``partial_rotary_factor`` of each head's channels (a quarter).

    x -> LayerNorm -> GQA self-attention with partial rotary -> + x -> LayerNorm -> SiLU-gated MLP -> +

StableLM 2 12B's per-head q/k LayerNorms (``qk_layernorm``) and parallel residual
(``use_parallel_residual``) are refused by name.
"""

from layers import Attention, LayerNorm
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape
from models.modeling_llama import LlamaMLP

REFUSED = {
    "qk_layernorm": "a LayerNorm of its own for each head of q and k",
    "use_parallel_residual": "attention and the MLP side by side on one norm",
}


class StableLmAttention(Attention):
    def __init__(self, config):
        super().__init__(**attention_shape(config), qkv_bias=config.use_qkv_bias)


class StableLmDecoderLayer(DecoderLayer):
    norm_layer = LayerNorm
    norm_eps_field = "layer_norm_eps"

    def __init__(self, config, layer_idx: int):
        for field, what in REFUSED.items():
            if getattr(config, field, False):
                raise ValueError(f"{field}=True ({what}) is not supported")
        super().__init__(config, StableLmAttention(config), LlamaMLP(config))


@register("StableLmForCausalLM")
class StableLmForCausalLM(CausalLM):
    decoder_layer = StableLmDecoderLayer
    partial_rotary = True
