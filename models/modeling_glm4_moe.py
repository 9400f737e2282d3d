"""GLM's mixtures of experts.

GLM-4.5 and GLM-4.6 (``Glm4MoeForCausalLM``): grouped-query attention with rotary on the first
``partial_rotary_factor`` of each head (half in GLM's configs), q/k/v bias, a per-head q/k RMSNorm where
``use_qk_norm``; DeepSeek-V3's mixture of experts on a Llama-style pre-norm block.

    x -> RMSNorm -> GQA self-attention -> + x -> RMSNorm -> MLP -> +
    MLP: dense on the first ``first_k_dense_replace`` layers, else sigmoid-routed experts (score
    correction bias to choose them, group-limited top-k, ``routed_scaling_factor``) plus ungated
    shared experts.

GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``): DeepSeek-V3's layer (multi-head latent attention, the same
MoE), each layer's MLP dense or sparse as ``mlp_layer_types`` says.

The multi-token-prediction layers of real checkpoints (``num_nextn_predict_layers`` past
``num_hidden_layers``) are skipped on load.
"""

from layers import Attention
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape
from models.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3MoE
from models.modeling_llama import LlamaMLP


class Glm4MoeAttention(Attention):
    def __init__(self, config):
        qk_norm_eps = config.rms_norm_eps if config.use_qk_norm else None
        super().__init__(**attention_shape(config), qkv_bias=config.attention_bias, qk_norm_eps=qk_norm_eps)


class Glm4MoeDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        mlp = DeepseekV3MoE(config) if layer_idx >= config.first_k_dense_replace else LlamaMLP(config)
        super().__init__(config, Glm4MoeAttention(config), mlp)


@register("Glm4MoeForCausalLM")
class Glm4MoeForCausalLM(CausalLM):
    decoder_layer = Glm4MoeDecoderLayer
    partial_rotary = True
    prediction_layers_field = "num_nextn_predict_layers"


MLP_LAYER_TYPES = ("dense", "sparse")


def is_sparse_mlp(config, layer_idx: int) -> bool:
    """Whether ``config.mlp_layer_types``, one of ``MLP_LAYER_TYPES`` for each layer, marks the layer's MLP
    sparse (GLM-4.7-Flash's and EXAONE MoE's rule)."""
    kinds = config.mlp_layer_types
    if len(kinds) != config.num_hidden_layers or not set(kinds) <= set(MLP_LAYER_TYPES):
        raise ValueError(f"mlp_layer_types must name one of {MLP_LAYER_TYPES} for each of the "
                         f"{config.num_hidden_layers} layers, got {kinds!r}")
    return kinds[layer_idx] == "sparse"


class Glm4MoeLiteDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        mlp = DeepseekV3MoE(config) if is_sparse_mlp(config, layer_idx) else LlamaMLP(config)
        super().__init__(config, DeepseekV3Attention(config, layer_idx), mlp)


@register("Glm4MoeLiteForCausalLM")
class Glm4MoeLiteForCausalLM(CausalLM):
    decoder_layer = Glm4MoeLiteDecoderLayer
    prediction_layers_field = "num_nextn_predict_layers"
