"""Qwen2-MoE: Qwen3-MoE's layer schedule and router, plus a shared expert every token takes
(``sigmoid(shared_expert_gate(x)) * shared_expert(x)``); Llama attention with ``qkv_bias``, no q/k-norm."""

from layers import Attention
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape, layer_types_window
from models.modeling_llama import LlamaMLP
from models.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, is_sparse_layer


class Qwen2MoeAttention(Attention):
    def __init__(self, config, layer_idx: int):
        super().__init__(**attention_shape(config, layer_types_window(config, layer_idx)), qkv_bias=config.qkv_bias)


class Qwen2MoeDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        if is_sparse_layer(config, layer_idx):
            mlp = Qwen3MoeSparseMoeBlock(config, shared_expert_intermediate_size=config.shared_expert_intermediate_size)
        else:
            mlp = LlamaMLP(config)
        super().__init__(config, Qwen2MoeAttention(config, layer_idx), mlp)


@register("Qwen2MoeForCausalLM")
class Qwen2MoeForCausalLM(CausalLM):
    decoder_layer = Qwen2MoeDecoderLayer
