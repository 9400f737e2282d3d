"""EXAONE MoE (LG AI Research's K-EXAONE-236B-A23B): EXAONE 4's attention on Llama's pre-norm block (HF's
EXAONE MoE norms each branch's input, where EXAONE 4 norms its output), whose MLP is dense or DeepSeek-V3's
mixture of experts as ``mlp_layer_types`` says.

    x -> RMSNorm -> GQA self-attention -> + x -> RMSNorm -> MLP -> +
    attention: an RMSNorm on each head of q and k, one weight for all heads; a window of ``sliding_window``
               on the layers ``layer_types`` marks sliding, rotary on those only (the others NoPE)
    MoE:       sigmoid of the router's float32 logits; the top ``num_experts_per_tok`` of ``num_experts``
               experts by the scores plus ``e_score_correction_bias``, from the ``topk_group`` of ``n_group``
               groups whose two best sum highest; their scores, renormalised where ``norm_topk_prob``, times
               ``routed_scaling_factor``, weigh them; plus one ungated shared MLP of
               ``num_shared_experts * moe_intermediate_size``

Hub checkpoints hold the correction bias in the block, ``mlp.e_score_correction_bias``; transformers 5's
module tree and zoo's in the router, ``mlp.gate.e_score_correction_bias``. Their multi-token-prediction
tensors (``mtp.*``) are skipped on load.
"""

from layers import SparseMoE
from models.auto import register
from models.base import CausalLM, DecoderLayer
from models.modeling_exaone4 import Exaone4Attention, Exaone4MLP
from models.modeling_glm4_moe import is_sparse_mlp


class ExaoneMoeSparseMoEBlock(SparseMoE):
    def __init__(self, config):
        super().__init__(
            config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.hidden_act, renormalize=config.norm_topk_prob,
            shared_experts_intermediate_size=config.moe_intermediate_size * config.num_shared_experts,
            scoring="sigmoid", score_correction_bias=True, num_groups=config.n_group, topk_groups=config.topk_group,
            scaling_factor=config.routed_scaling_factor,
        )


class ExaoneMoeDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        mlp = ExaoneMoeSparseMoEBlock(config) if is_sparse_mlp(config, layer_idx) else Exaone4MLP(config)
        super().__init__(config, Exaone4Attention(config, layer_idx), mlp)


@register("ExaoneMoeForCausalLM")
class ExaoneMoeForCausalLM(CausalLM):
    decoder_layer = ExaoneMoeDecoderLayer
    ignored_checkpoint_keys = (*CausalLM.ignored_checkpoint_keys, r"^mtp\.")
    checkpoint_aliases = ((r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.e_score_correction_bias"),)
