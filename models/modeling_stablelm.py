"""StableLM (StableLM 2 1.6B, StableLM 3B-4E1T, their chat models): Llama's pre-norm block with
LayerNorm (weight and bias) for every norm, a bias on q, k and v where ``use_qkv_bias``, and rotary
on the first ``partial_rotary_factor`` of each head's channels (a quarter); with
``use_parallel_residual``, attention and the MLP side by side on the one ``input_layernorm``.

    x -> LayerNorm -> GQA self-attention with partial rotary -> + x -> LayerNorm -> SiLU-gated MLP -> +
    use_parallel_residual: n = LayerNorm(x); x = x + attention(n) + MLP(n)

StableLM 2 12B's per-head q/k LayerNorms (``qk_layernorm``) are refused by name.
"""

from layers import Attention, LayerNorm
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape
from models.modeling_llama import LlamaMLP



class StableLmAttention(Attention):
    def __init__(self, config):
        super().__init__(**attention_shape(config), qkv_bias=config.use_qkv_bias)


class StableLmDecoderLayer(DecoderLayer):
    norm_layer = LayerNorm
    norm_eps_field = "layer_norm_eps"

    def __init__(self, config, layer_idx: int):
        if config.qk_layernorm:
            raise ValueError("qk_layernorm=True (a LayerNorm of its own for each head of q and k) is not supported")
        super().__init__(config, StableLmAttention(config), LlamaMLP(config), parallel=config.use_parallel_residual)


@register("StableLmForCausalLM")
class StableLmForCausalLM(CausalLM):
    decoder_layer = StableLmDecoderLayer
    partial_rotary = True
