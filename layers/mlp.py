"""The gated MLP of Llama-style blocks: down(act(gate(x)) * up(x)), gate and up fused."""

import torch
from torch import nn

from layers.linear import Linear, MergedLinear
from ops_cuda import ACTIVATIONS


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False):
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: {sorted(ACTIVATIONS)}")
        self.hidden_act = hidden_act
        self.gate_up_proj = MergedLinear(
            hidden_size, [intermediate_size] * 2, sources=["gate_proj", "up_proj"], bias=bias
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # down_proj applies act(gate) * up as it reads gate_up's output: one kernel for a single GPU row.
        return self.down_proj(self.gate_up_proj(x), activation=self.hidden_act)
