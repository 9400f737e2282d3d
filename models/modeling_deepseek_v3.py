"""DeepSeek-V3 (also what Kimi-K2 and Moonlight checkpoints declare) and DeepSeek-V2: multi-head latent
attention and a DeepSeek MoE on a Llama-style pre-norm block.

    x -> RMSNorm -> MLA (low-rank q, compressed KV latent, decoupled rope key) -> + x -> RMSNorm -> MLP -> +
    MLP: dense on the first ``first_k_dense_replace`` layers, else sigmoid-routed experts (score
    correction bias to choose them, group-limited top-k, ``routed_scaling_factor``) plus ungated
    shared experts.

The multi-token-prediction layers real checkpoints carry past ``num_hidden_layers``
(``num_nextn_predict_layers`` of them) are not used for generation and are skipped on load.

DeepSeek-V2 differs in its router only: softmax scores, top-k over all experts (``topk_method``
greedy) or over the ``topk_group`` groups with the best single expert (group_limited_greedy), never
renormalised, times ``routed_scaling_factor``. Its rope rotates the same interleaved pairs and
writes them back in place, a fixed permutation of q's and k's rope channels that q.k does not see.
"""

import math

from layers import SparseMoE, rope_parameters
from layers.mla import MLAttention
from models.auto import register
from models.base import CausalLM, DecoderLayer
from models.modeling_llama import LlamaMLP


def softmax_scale(config) -> float:
    """HF's: ``qk_head_dim**-0.5``, times YaRN's ``mscale(factor, mscale_all_dim)`` squared."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and mscale_all_dim and params["factor"] > 1:
        mscale = 0.1 * mscale_all_dim * math.log(params["factor"]) + 1.0
        scale = scale * mscale * mscale
    return scale


class DeepseekV3Attention(MLAttention):
    def __init__(self, config, layer_idx: int):
        super().__init__(
            config.hidden_size, config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank,
            config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, softmax_scale(config),
            rope_interleave=config.rope_interleave, bias=config.attention_bias,
        )


class DeepseekV3MoE(SparseMoE):
    def __init__(self, config):
        super().__init__(
            config.hidden_size, config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.hidden_act, renormalize=config.norm_topk_prob,
            shared_experts_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
            scoring="sigmoid", score_correction_bias=True, num_groups=config.n_group, topk_groups=config.topk_group,
            scaling_factor=config.routed_scaling_factor,
        )


class DeepseekV3DecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        mlp = DeepseekV3MoE(config) if layer_idx >= config.first_k_dense_replace else LlamaMLP(config)
        super().__init__(config, DeepseekV3Attention(config, layer_idx), mlp)


@register("DeepseekV3ForCausalLM")
class DeepseekV3ForCausalLM(CausalLM):
    decoder_layer = DeepseekV3DecoderLayer
    prediction_layers_field = "num_nextn_predict_layers"


class DeepseekV2MoE(SparseMoE):
    def __init__(self, config):
        if config.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"unsupported topk_method {config.topk_method!r}; supported: greedy, group_limited_greedy")
        grouped = config.topk_method == "group_limited_greedy"
        super().__init__(
            config.hidden_size, config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.hidden_act, renormalize=False,
            shared_experts_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
            shared_experts_bias=config.mlp_bias,
            num_groups=config.n_group if grouped else 1, topk_groups=config.topk_group if grouped else 1,
            group_score="max", scaling_factor=config.routed_scaling_factor,
        )


class DeepseekV2Attention(MLAttention):
    def __init__(self, config, layer_idx: int):
        super().__init__(
            config.hidden_size, config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank,
            config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, softmax_scale(config),
            rope_interleave=True, bias=config.attention_bias,
        )


class DeepseekV2DecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        mlp = DeepseekV2MoE(config) if layer_idx >= config.first_k_dense_replace else LlamaMLP(config)
        super().__init__(config, DeepseekV2Attention(config, layer_idx), mlp)


@register("DeepseekV2ForCausalLM")
class DeepseekV2ForCausalLM(CausalLM):
    decoder_layer = DeepseekV2DecoderLayer
