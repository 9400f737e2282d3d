"""The gated MLP of Llama-style blocks: down(act(gate(x)) * up(x)), gate and up fused."""

import torch
from torch import nn

from layers.linear import Linear, MergedLinear
from ops_cuda import ACTIVATIONS, act_and_mul
from ops_cuda.linear import gated_linear


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
        gate_up = self.gate_up_proj
        if gate_up.fp8_block is None:  # on one GPU row, act(gate) * up straight from the weight in one kernel
            h = gated_linear(x, gate_up.weight, gate_up.bias, self.hidden_act, gate_up.packed)
        else:
            h = act_and_mul(gate_up(x), self.hidden_act)
        return self.down_proj(h)
