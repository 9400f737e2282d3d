"""EXAONE 4.0 (LG AI Research's EXAONE-4.0-1.2B and EXAONE-4.0-32B): each branch's norm after it and
none before (OLMo 2's place of the norms) and an RMSNorm on each head of q and of k before rotary, one
weight for all heads (Qwen3's): EXAONE's "QK-Reorder-Norm"; Llama's RMSNorm, rotary and SiLU-gated
MLP, no bias. Hybrid attention: a window of ``sliding_window`` on the layers ``config.layer_types`` marks
``sliding_attention`` (three of every four in the 32B), and, where the config sets a window, rotary on
those layers only: the others attend to every earlier position with no position embedding (NoPE).
Where the config sets no window, every layer rotates (the 1.2B attends globally on every layer).

    x -> GQA self-attention (RMSNorm on each head of q and k, then rotary unless NoPE) -> RMSNorm -> + x
      -> SiLU-gated MLP -> RMSNorm -> +

A layer ``layer_types`` marks ``sliding_attention`` while ``sliding_window`` is null is refused by name:
HF's EXAONE 4 cannot build its sliding-window mask.
"""

from layers import Attention, GatedMLP
from models.auto import register
from models.base import CausalLM, DecoderLayer, NormSlots, attention_shape, layer_types_window


class Exaone4Attention(Attention):
    """HF rotates where the layer has a window, or everywhere where the config sets none."""

    def __init__(self, config, layer_idx: int):
        if config.sliding_window is None and config.layer_types[layer_idx] == "sliding_attention":
            raise ValueError(f"layer_types marks layer {layer_idx} sliding_attention with sliding_window null "
                             "(HF's EXAONE 4 cannot build its sliding-window mask)")
        window = layer_types_window(config, layer_idx)
        super().__init__(**attention_shape(config, window), qk_norm_eps=config.rms_norm_eps,
                         rotary=config.sliding_window is None or window is not None)


class Exaone4MLP(GatedMLP):
    def __init__(self, config):
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_act)


class Exaone4DecoderLayer(DecoderLayer):
    norms = NormSlots(
        pre_attention=None, post_attention="post_attention_layernorm", pre_mlp=None,
        post_mlp="post_feedforward_layernorm",
    )

    def __init__(self, config, layer_idx: int):
        super().__init__(config, Exaone4Attention(config, layer_idx), Exaone4MLP(config))


@register("Exaone4ForCausalLM")
class Exaone4ForCausalLM(CausalLM):
    decoder_layer = Exaone4DecoderLayer
