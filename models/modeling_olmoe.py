"""OLMoE (OLMoE-1B-7B and its Instruct model): Llama's pre-norm block and RMSNorm, with RMSNorm on q and
k over the whole projection (before the split into heads), q, k and v clamped to ``[-clip_qkv,
clip_qkv]`` after it where the config sets ``clip_qkv``, and a sparse mixture of ``num_experts``
experts of ``intermediate_size`` as every layer's MLP.

    x -> RMSNorm -> attn (q/k RMSNorm over all heads) -> + x -> RMSNorm -> MoE -> +
    router: softmax -> top ``num_experts_per_tok``, renormalised when ``norm_topk_prob`` (not in OLMoE-1B-7B)

Its checkpoints spell the MoE as Qwen-MoE's do (``mlp.gate``, ``mlp.experts.{e}.gate_proj/up_proj/down_proj``).
"""

from layers import Attention, SparseMoE
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape


class OlmoeAttention(Attention):
    def __init__(self, config):
        bias = config.attention_bias
        # No window: HF's OLMoE masks causally, and a config's sliding_window reaches its flash-attention path alone.
        super().__init__(
            **attention_shape(config), qkv_bias=bias, o_bias=bias, qk_norm_eps=config.rms_norm_eps,
            qk_norm_per_head=False, clip_qkv=config.clip_qkv,
        )


class OlmoeSparseMoeBlock(SparseMoE):
    def __init__(self, config):
        super().__init__(
            config.hidden_size, config.num_experts, config.num_experts_per_tok, config.intermediate_size,
            config.hidden_act, renormalize=config.norm_topk_prob,
        )


class OlmoeDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, OlmoeAttention(config), OlmoeSparseMoeBlock(config))


@register("OlmoeForCausalLM")
class OlmoeForCausalLM(CausalLM):
    decoder_layer = OlmoeDecoderLayer
