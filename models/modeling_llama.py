"""Llama, and the checkpoints that share its block: Mistral (``config.sliding_window`` on every layer),
Ministral (Mistral's, with windows on the layers ``config.layer_types`` marks), CWM (Ministral's, with
``mlp_bias``), Qwen2 (q/k/v bias, windows on the layers ``config.layer_types`` marks), Seed-OSS (o_proj's
bias a setting of its own) and Phi-3 (Mistral's block;
its checkpoints hold q/k/v and gate/up stacked, as ``qkv_proj`` and ``gate_up_proj``, which the
fused layers read whole; its ``partial_rotary_factor`` rotates the first channels of each head).

    x -> RMSNorm -> GQA self-attention with rotary -> + x -> RMSNorm -> SiLU-gated MLP -> +
"""

from layers import Attention, GatedMLP
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape, layer_types_window


class LlamaAttention(Attention):
    def __init__(self, config, sliding_window: int | None = None):
        bias = getattr(config, "attention_bias", False)
        super().__init__(**attention_shape(config, sliding_window), qkv_bias=bias, o_bias=bias)


class LlamaMLP(GatedMLP):
    def __init__(self, config):
        super().__init__(
            config.hidden_size, config.intermediate_size, config.hidden_act, bias=getattr(config, "mlp_bias", False)
        )


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, LlamaAttention(config), LlamaMLP(config))


@register("LlamaForCausalLM")
class LlamaForCausalLM(CausalLM):
    decoder_layer = LlamaDecoderLayer


class MistralDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, LlamaAttention(config, config.sliding_window), LlamaMLP(config))


@register("MistralForCausalLM")
class MistralForCausalLM(CausalLM):
    decoder_layer = MistralDecoderLayer


@register("Phi3ForCausalLM")
class Phi3ForCausalLM(CausalLM):
    decoder_layer = MistralDecoderLayer
    partial_rotary = True


class MinistralAttention(Attention):
    """Mistral's attention (no bias) with a window on the layers ``config.layer_types`` marks sliding."""

    def __init__(self, config, layer_idx: int):
        super().__init__(**attention_shape(config, layer_types_window(config, layer_idx)))


class MinistralDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, MinistralAttention(config, layer_idx), LlamaMLP(config))


@register("MinistralForCausalLM")
class MinistralForCausalLM(CausalLM):
    decoder_layer = MinistralDecoderLayer


@register("CwmForCausalLM")
class CwmForCausalLM(CausalLM):
    """Ministral's block; HF's CWM MLP has Llama's bias where ``mlp_bias``, which ``LlamaMLP`` reads."""

    decoder_layer = MinistralDecoderLayer


class Qwen2Attention(Attention):
    """Llama attention with a bias on q, k and v (none on o_proj)."""

    def __init__(self, config, layer_idx: int):
        super().__init__(**attention_shape(config, layer_types_window(config, layer_idx)), qkv_bias=True)


class Qwen2DecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, Qwen2Attention(config, layer_idx), LlamaMLP(config))


@register("Qwen2ForCausalLM")
class Qwen2ForCausalLM(CausalLM):
    decoder_layer = Qwen2DecoderLayer


class SeedOssAttention(Attention):
    """Llama attention with q/k/v bias where ``attention_bias`` and an o_proj bias where ``attention_out_bias``."""

    def __init__(self, config):
        super().__init__(**attention_shape(config), qkv_bias=config.attention_bias, o_bias=config.attention_out_bias)


class SeedOssDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, SeedOssAttention(config), LlamaMLP(config))


@register("SeedOssForCausalLM")
class SeedOssForCausalLM(CausalLM):
    decoder_layer = SeedOssDecoderLayer
