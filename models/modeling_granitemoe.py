"""GraniteMoe (IBM's Granite 3.0 and 3.1 MoE models: granite-3.0-1b-a400m, 3b-a800m) and GraniteMoeShared:
Granite's block and four multipliers with Mixtral's mixture of experts as its MLP, and in GraniteMoeShared
a dense MLP of ``shared_intermediate_size`` beside the experts (none where it is 0).

    x = embeddings * embedding_multiplier
    each layer: h = x + residual_multiplier * attention(RMSNorm(x)), its scores scaled by attention_multiplier
                y = RMSNorm(h)
                x = h + residual_multiplier * (block_sparse_moe(y) + shared_mlp(y))
    block_sparse_moe(y) = sum over the top num_experts_per_tok of the num_local_experts router logits
                          of softmax(those logits)_e * down_e(silu(gate_e y) * up_e y)
    logits = lm_head(RMSNorm(x)) / logits_scaling

The softmax over the top-k logits is the full softmax's top-k renormalised: Mixtral's router.

Hub checkpoints spell the MoE ``block_sparse_moe.{router.layer, input_linear, output_linear}.weight``,
each expert's gate rows before its up rows in ``input_linear`` [E, 2I, H], and the shared MLP
``shared_mlp.{input_linear, output_linear}.weight`` (gate rows, then up rows). transformers 5's module
tree (which it saves with ``save_original_format=False``) holds the experts stacked as zoo's are,
``block_sparse_moe.experts.{gate_up_proj, down_proj}``, and the router as ``block_sparse_moe.router``.
"""

from layers import GatedMLP
from models.auto import register
from models.base import DecoderLayer
from models.modeling_granite import GraniteAttention, GraniteForCausalLM
from models.modeling_mixtral import MixtralSparseMoeBlock


class GraniteMoeDecoderLayer(DecoderLayer):
    mlp_name = "block_sparse_moe"

    def __init__(self, config, layer_idx: int, shared_mlp: GatedMLP | None = None):
        super().__init__(config, GraniteAttention(config), MixtralSparseMoeBlock(config),
                         branch_scale=config.residual_multiplier, shared_mlp=shared_mlp)


class GraniteMoeSharedDecoderLayer(GraniteMoeDecoderLayer):
    def __init__(self, config, layer_idx: int):
        size = config.shared_intermediate_size
        super().__init__(config, layer_idx, GatedMLP(config.hidden_size, size, config.hidden_act) if size else None)


@register("GraniteMoeForCausalLM")
class GraniteMoeForCausalLM(GraniteForCausalLM):
    decoder_layer = GraniteMoeDecoderLayer
    checkpoint_aliases = (
        (r"\.block_sparse_moe\.gate\.", ".block_sparse_moe.router."),
        (r"\.block_sparse_moe\.router\.weight$", ".block_sparse_moe.router.layer.weight"),
        (r"\.block_sparse_moe\.experts\.gate_up_proj$", ".block_sparse_moe.input_linear.weight"),
        (r"\.block_sparse_moe\.experts\.down_proj$", ".block_sparse_moe.output_linear.weight"),
    )


@register("GraniteMoeSharedForCausalLM")
class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    decoder_layer = GraniteMoeSharedDecoderLayer
    checkpoint_aliases = GraniteMoeForCausalLM.checkpoint_aliases + (
        (r"\.shared_mlp\.gate_up_proj\.", ".shared_mlp.input_linear."),
        (r"\.shared_mlp\.down_proj\.", ".shared_mlp.output_linear."),
    )
