"""MiniMax-M2 (MiniMax-M2, MiniMax-M2.1): a Llama-style pre-norm block, an RMSNorm on q and on k over the
whole projection before rotary, rotary on the first ``partial_rotary_factor`` of each head (configs give
``rotary_dim``, which transformers turns into the factor), and a mixture of ``num_local_experts`` experts of
``intermediate_size`` with a sigmoid router.

    x -> RMSNorm -> GQA self-attention -> + x -> RMSNorm -> MoE -> +
    MoE: sigmoid of the router's logits (taken in the model's dtype) in float32; the top
    ``num_experts_per_tok`` experts by the scores plus ``e_score_correction_bias``; their scores,
    renormalised, weigh them. No shared expert.

Hub checkpoints spell the MoE ``block_sparse_moe.{gate, experts.{e}.w1/w3/w2, e_score_correction_bias}``,
transformers 5 ``mlp.{gate, experts, e_score_correction_bias}``; zoo's bias sits in the router,
``mlp.gate.e_score_correction_bias``.
"""

from layers import Attention, SparseMoE
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape
from models.modeling_mixtral import MixtralForCausalLM


class MiniMaxM2Attention(Attention):
    def __init__(self, config):
        super().__init__(**attention_shape(config), qk_norm_eps=config.rms_norm_eps, qk_norm_per_head=False)


class MiniMaxM2SparseMoeBlock(SparseMoE):
    def __init__(self, config):
        super().__init__(
            config.hidden_size, config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
            config.hidden_act, renormalize=True, scoring="sigmoid", score_correction_bias=True,
            model_dtype_logits=True,
        )


class MiniMaxM2DecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, MiniMaxM2Attention(config), MiniMaxM2SparseMoeBlock(config))


@register("MiniMaxM2ForCausalLM")
class MiniMaxM2ForCausalLM(CausalLM):
    decoder_layer = MiniMaxM2DecoderLayer
    partial_rotary = True
    checkpoint_aliases = (
        (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.e_score_correction_bias"),
        (r"\.mlp\.e_score_correction_bias$", ".block_sparse_moe.e_score_correction_bias"),
        *MixtralForCausalLM.checkpoint_aliases,
    )
