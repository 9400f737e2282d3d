"""StableLM (StableLM 2 1.6B and 12B, StableLM 3B-4E1T, their chat models): Llama's pre-norm block with
LayerNorm (weight and bias) for every norm, a bias on q, k and v where ``use_qkv_bias``, and rotary
on the first ``partial_rotary_factor`` of each head's channels (a quarter); with
``use_parallel_residual``, attention and the MLP side by side on the one ``input_layernorm``; with
``qk_layernorm``, a bias-free LayerNorm on each head of q and of k, with a weight of its own per head,
before rotary (StableLM 2 12B has both).

    x -> LayerNorm -> GQA self-attention with partial rotary -> + x -> LayerNorm -> SiLU-gated MLP -> +
    use_parallel_residual: n = LayerNorm(x); x = x + attention(n) + MLP(n)

HF's per-head norms are a ModuleList of LayerNorms, ``q_layernorm.norms.{h}``; zoo's ``q_layernorm``
holds their weights stacked, [heads, head_dim], filled from those tensors by the loader.
"""

from functools import partial

from layers import Attention, LayerNorm
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape
from models.modeling_llama import LlamaMLP


class StableLmAttention(Attention):
    qk_norm_names = ("q_layernorm", "k_layernorm")

    def __init__(self, config):
        super().__init__(
            **attention_shape(config), qkv_bias=config.use_qkv_bias,
            qk_norm_eps=config.layer_norm_eps if config.qk_layernorm else None, qk_norm_weight_per_head=True,
            qk_norm=partial(LayerNorm, bias=False),
        )


class StableLmDecoderLayer(DecoderLayer):
    norm_layer = LayerNorm
    norm_eps_field = "layer_norm_eps"

    def __init__(self, config, layer_idx: int):
        super().__init__(config, StableLmAttention(config), LlamaMLP(config), parallel=config.use_parallel_residual)


@register("StableLmForCausalLM")
class StableLmForCausalLM(CausalLM):
    decoder_layer = StableLmDecoderLayer
    partial_rotary = True
