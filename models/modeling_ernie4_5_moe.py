"""ERNIE 4.5 MoE (Baidu's ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B): ERNIE 4.5's block (rotary on the
interleaved channel pairs from float32 tables, a bias on every projection where ``use_bias``) whose MLP is
a mixture of experts on every ``moe_layer_interval``-th layer from ``moe_layer_start_index`` to
``moe_layer_end_index``, a dense MLP of ``intermediate_size`` elsewhere.

    x -> RMSNorm -> GQA self-attention -> + x -> RMSNorm -> MLP -> +
    MoE: softmax of the router's logits, taken in float32 by a weight kept in float32; the top ``moe_k``
         of ``moe_num_experts`` experts by the probabilities plus ``e_score_correction_bias``, weighed by
         their probabilities divided by their sum (or by ``moe_norm_min`` where the sum is smaller); plus
         one ungated shared MLP of ``moe_num_shared_experts * moe_intermediate_size``
    LM head: with a bias where ``use_bias``

HF's module tree holds the correction bias in the router, ``mlp.gate.moe_statics.e_score_correction_bias``
of shape [1, experts]; hub checkpoints in the block, ``mlp.moe_statics.e_score_correction_bias``. Their
multi-token-prediction tensors (``model.mtp_*``) are skipped on load.
"""

import torch

from layers import Shard, SparseMoE, TopKRouter
from models.auto import register
from models.base import CausalLM, DecoderLayer
from models.modeling_ernie4_5 import Ernie4_5Attention, Ernie4_5MLP


def is_sparse_layer(config, layer_idx: int) -> bool:
    """HF's rule (its config turns a ``moe_layer_end_index`` of -1 into the last layer)."""
    return ((layer_idx + 1) % config.moe_layer_interval == 0
            and config.moe_layer_start_index <= layer_idx <= config.moe_layer_end_index)


class Ernie4_5_MoeTopKRouter(TopKRouter):
    """HF's storage of ERNIE's router: its weight stays float32 in a model of any dtype (HF's
    ``_keep_in_fp32_modules_strict``), and its correction bias is the one row of ``moe_statics``'s."""

    def empty_parameter(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return super().empty_parameter(name, torch.float32 if name == "weight" else dtype, device)

    def checkpoint_shards(self, prefix: str) -> dict[str, list[Shard]]:
        return {"e_score_correction_bias": [Shard(f"{prefix}.moe_statics.e_score_correction_bias", (), (0,))]}


class Ernie4_5_MoeSparseMoeBlock(SparseMoE):
    router_type = Ernie4_5_MoeTopKRouter

    def __init__(self, config):
        super().__init__(
            config.hidden_size, config.moe_num_experts, config.moe_k, config.moe_intermediate_size,
            config.hidden_act, renormalize=True, renormalize_min=config.moe_norm_min, score_correction_bias=True,
            shared_experts_intermediate_size=config.moe_intermediate_size * config.moe_num_shared_experts,
            shared_experts_bias=config.use_bias,
        )


class Ernie4_5_MoeDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        mlp = Ernie4_5_MoeSparseMoeBlock(config) if is_sparse_layer(config, layer_idx) else Ernie4_5MLP(config)
        super().__init__(config, Ernie4_5Attention(config), mlp)


@register("Ernie4_5_MoeForCausalLM")
class Ernie4_5_MoeForCausalLM(CausalLM):
    decoder_layer = Ernie4_5_MoeDecoderLayer
    lm_head_bias_field = "use_bias"
    ignored_checkpoint_keys = (*CausalLM.ignored_checkpoint_keys, r"^model\.mtp_")
    checkpoint_aliases = ((r"\.mlp\.gate\.moe_statics\.", ".mlp.moe_statics."),)
