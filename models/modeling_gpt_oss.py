"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): a pre-norm block of grouped-query attention with attention
sinks, on every other layer within a sliding window, and a mixture of experts with biases and a
clamped SwiGLU.

    x -> RMSNorm -> attention -> + x -> RMSNorm -> MoE -> +
    attention: q/k/v/o with biases, rotary (YaRN), one learned sink logit per query head joining
               its softmax as a key of value zero; ``layer_types`` alternates a ``sliding_window``
               layer and a full one
    MoE:       router logits with a bias, the top ``num_experts_per_tok`` of ``num_local_experts``,
               softmax over those k; each expert down(act(gate x + b) (up x + b)) + b with
               act the clamped SwiGLU: gate clamped <= 7, up to [-7, 7], gate sigmoid(1.702 gate) (up + 1)
    RMSNorm:   the weight multiplied in float32 (HF keeps the norms' weights in float32)

Checkpoints store each layer's experts as transformers' parameters: ``gate_up_proj`` [E, H, 2I] with
gate and up in alternate columns, ``down_proj`` [E, I, H], each an input-by-output matrix; the loader
reads them transposed into zoo's [E, 2I, H] (gate rows, then up rows) and [E, H, I].
"""

from functools import partial

from layers import Attention, Experts, RMSNorm, Shard, SparseMoE
from layers.moe import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape, layer_types_window

GptOssRMSNorm = partial(RMSNorm, multiply_in_float32=True)


class GptOssAttention(Attention):
    def __init__(self, config, layer_idx: int):
        bias = config.attention_bias
        super().__init__(**attention_shape(config, layer_types_window(config, layer_idx)), qkv_bias=bias,
                         o_bias=bias, sinks=True)


class GptOssExperts(Experts):
    """The experts under transformers' layout of GPT-OSS's parameters (the module docstring)."""

    def checkpoint_shards(self, prefix: str) -> dict[str, list[Shard]]:
        size, every, evens, odds = self.intermediate_size, slice(None), slice(0, None, 2), slice(1, None, 2)
        gate, up = slice(0, size), slice(size, 2 * size)
        return {
            "gate_up_proj": [Shard(f"{prefix}.gate_up_proj", (every, rows), (every, every, columns), transposed=True)
                             for rows, columns in ((gate, evens), (up, odds))],
            "gate_up_proj_bias": [Shard(f"{prefix}.gate_up_proj_bias", (every, rows), (every, columns))
                                  for rows, columns in ((gate, evens), (up, odds))],
            "down_proj": [Shard(f"{prefix}.down_proj", (), (), transposed=True)],
            "down_proj_bias": [Shard(f"{prefix}.down_proj_bias")],
        }


class GptOssMLP(SparseMoE):
    router_name = "router"
    experts_type = GptOssExperts

    def __init__(self, config):
        # transformers before 5.23 fixes both in its experts: its config has neither field
        alpha = getattr(config, "swiglu_alpha", CLAMPED_SWIGLU_ALPHA)
        limit = getattr(config, "swiglu_limit", CLAMPED_SWIGLU_LIMIT)
        if (alpha, limit) != (CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT):
            raise ValueError(f"GPT-OSS experts with swiglu_alpha={alpha}, swiglu_limit={limit}: zoo's clamped SwiGLU "
                             f"computes with {CLAMPED_SWIGLU_ALPHA} and {CLAMPED_SWIGLU_LIMIT}, every released model's")
        super().__init__(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                         config.intermediate_size, "clamped_swiglu", renormalize=True, expert_bias=True, bias=True)


class GptOssDecoderLayer(DecoderLayer):
    norm_layer = GptOssRMSNorm

    def __init__(self, config, layer_idx: int):
        super().__init__(config, GptOssAttention(config, layer_idx), GptOssMLP(config))


@register("GptOssForCausalLM")
class GptOssForCausalLM(CausalLM):
    decoder_layer = GptOssDecoderLayer
