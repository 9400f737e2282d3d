"""Mixtral: Mistral's block (sliding window from ``config.sliding_window`` on every layer) whose MLP is
a sparse mixture of ``num_local_experts`` experts of ``intermediate_size``, top ``num_experts_per_tok``
with renormalised weights.

Hub checkpoints spell the MoE ``block_sparse_moe.{gate, experts.{e}.w1/w3/w2}``; transformers 5's module
tree (and zoo's) is ``mlp.{gate, experts}``, with w1/w3/w2 = gate/up/down.
"""

from layers import SparseMoE
from models.auto import register
from models.base import CausalLM, DecoderLayer
from models.modeling_llama import LlamaAttention


class MixtralSparseMoeBlock(SparseMoE):
    def __init__(self, config):
        super().__init__(
            config.hidden_size, config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
            config.hidden_act, renormalize=True,
        )


class MixtralDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, LlamaAttention(config, config.sliding_window), MixtralSparseMoeBlock(config))


@register("MixtralForCausalLM")
class MixtralForCausalLM(CausalLM):
    decoder_layer = MixtralDecoderLayer
    checkpoint_aliases = (
        (r"\.mlp\.gate\.", ".block_sparse_moe.gate."),
        (r"\.mlp\.experts\.(\d+)\.gate_proj\.", r".block_sparse_moe.experts.\1.w1."),
        (r"\.mlp\.experts\.(\d+)\.up_proj\.", r".block_sparse_moe.experts.\1.w3."),
        (r"\.mlp\.experts\.(\d+)\.down_proj\.", r".block_sparse_moe.experts.\1.w2."),
    )
