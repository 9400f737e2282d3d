"""SmolLM3 (HuggingFace's SmolLM3-3B): Llama's block, with no position embedding at all on the layers
``config.no_rope_layers`` marks 0 (NoPE: by default every ``no_rope_layer_interval``-th layer), and a
window of ``sliding_window`` on the layers ``layer_types`` marks ``sliding_attention`` (with
``use_sliding_window``, HF's config marks the NoPE layers). Tied embeddings by default.

    x -> RMSNorm -> GQA self-attention, rotary on q and k except in NoPE layers -> + x
      -> RMSNorm -> SiLU-gated MLP -> +

A layer ``layer_types`` marks sliding while ``use_sliding_window`` is off is refused by name: HF's
eager and sdpa attention window it, its flash attention does not.
"""

from layers import Attention
from models.auto import register
from models.base import CausalLM, DecoderLayer, attention_shape, layer_types_window
from models.modeling_llama import LlamaMLP


class SmolLM3Attention(Attention):
    """Llama attention (``attention_bias`` on q, k, v and o) with the layer's rotary and window."""

    def __init__(self, config, layer_idx: int):
        if layer_idx >= len(config.no_rope_layers):
            raise ValueError(f"no_rope_layers has no entry for layer {layer_idx} "
                             f"(num_hidden_layers={config.num_hidden_layers})")
        if config.layer_types[layer_idx] == "sliding_attention" and not config.use_sliding_window:
            raise ValueError(f"layer_types marks layer {layer_idx} sliding_attention with use_sliding_window=False "
                             "(HF's eager and sdpa attention window it, its flash attention does not)")
        bias = config.attention_bias
        super().__init__(**attention_shape(config, layer_types_window(config, layer_idx)), qkv_bias=bias, o_bias=bias,
                         rotary=bool(config.no_rope_layers[layer_idx]))


class SmolLM3DecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, SmolLM3Attention(config, layer_idx), LlamaMLP(config))


@register("SmolLM3ForCausalLM")
class SmolLM3ForCausalLM(CausalLM):
    decoder_layer = SmolLM3DecoderLayer
