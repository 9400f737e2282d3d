"""Qwen3-MoE: Qwen3's block whose MLP is a sparse mixture of experts on every ``decoder_sparse_step``-th
layer outside ``mlp_only_layers`` (a dense MLP of ``intermediate_size`` elsewhere).

    router: softmax -> top ``num_experts_per_tok`` of ``num_experts``, renormalised when ``norm_topk_prob``
"""

from layers import SparseMoE
from models.auto import register
from models.base import CausalLM, DecoderLayer
from models.modeling_llama import LlamaMLP
from models.modeling_qwen3 import Qwen3Attention


def is_sparse_layer(config, layer_idx: int) -> bool:
    """HF's rule, shared by Qwen2-MoE and Qwen3-MoE."""
    return (
        layer_idx not in config.mlp_only_layers
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


class Qwen3MoeSparseMoeBlock(SparseMoE):
    def __init__(self, config, shared_expert_intermediate_size: int | None = None):
        super().__init__(
            config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.hidden_act, renormalize=config.norm_topk_prob,
            shared_expert_intermediate_size=shared_expert_intermediate_size,
        )


class Qwen3MoeDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        mlp = Qwen3MoeSparseMoeBlock(config) if is_sparse_layer(config, layer_idx) else LlamaMLP(config)
        # HF's Qwen3-MoE puts config.sliding_window (None unless use_sliding_window) on every layer.
        super().__init__(config, Qwen3Attention(config, config.sliding_window), mlp)


@register("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(CausalLM):
    decoder_layer = Qwen3MoeDecoderLayer
