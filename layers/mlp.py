"""The gated MLP of Llama-style blocks: down(act(gate(x)) * up(x)), gate and up fused; the ungated
MLP, down(act(up(x))) (Starcoder2's, Arcee's); and the activations of ungated MLPs (theirs, CLIP's).

Where ``linear`` would multiply by gate_up with zoo::gemv (a single float16/bfloat16 GPU row, batch-1
decode), zoo::gated_gemv computes act(gate x) * up x in that product's kernel; on the output of a split
RMSNorm (``layers.norm.NormedRow``), zoo::normed_gated_gemv, which also applies the norm's 1 / rms.
"""

import torch
from torch import nn

from layers.linear import Linear, MergedLinear
from layers.norm import NormedRow
from ops_cuda import ACTIVATIONS, GATED_ACTIVATIONS, act_and_mul, gated_gemv, normed_gated_gemv
from ops_cuda.linear import takes_gemv


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    # HF's ReLUSquaredActivation: relu, then its square, each rounded to x's dtype.
    return torch.square(torch.relu(x))


# HuggingFace `hidden_act` names of ungated MLPs -> the function.
PLAIN_ACTIVATIONS = {**ACTIVATIONS, "quick_gelu": quick_gelu, "relu2": relu_squared}


def plain_activation(name: str):
    if name not in PLAIN_ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(PLAIN_ACTIVATIONS)}")
    return PLAIN_ACTIVATIONS[name]


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False):
        super().__init__()
        if hidden_act not in GATED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: {sorted(GATED_ACTIVATIONS)}")
        self.hidden_act = hidden_act
        self.gate_up_proj = MergedLinear(
            hidden_size, [intermediate_size] * 2, sources=["gate_proj", "up_proj"], bias=bias
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor | NormedRow) -> torch.Tensor:
        gate_up = self.gate_up_proj
        # act(gate) * up in the product's kernel, and a split norm's 1 / rms with it
        plain = gate_up.fp8_block is None
        if isinstance(x, NormedRow) and plain and x.takes(gate_up.weight):
            h = normed_gated_gemv(x.weighted, x.stats, x.eps, gate_up.weight, gate_up.bias, self.hidden_act)
        elif isinstance(x, torch.Tensor) and plain and takes_gemv(x, gate_up.weight):
            h = gated_gemv(x, gate_up.weight, gate_up.bias, self.hidden_act)
        else:
            h = act_and_mul(gate_up(x), self.hidden_act)
        return self.down_proj(h)


class UngatedMLP(nn.Module):
    """down(act(up(x))), its two projections under HF's names: ``up_name`` and ``down_name``
    (Arcee's ``up_proj`` and ``down_proj``; Starcoder2's ``c_fc`` and ``c_proj``; CLIP's ``fc1`` and
    ``fc2``). The activation is
    one of ``PLAIN_ACTIVATIONS``, torch's elementwise ops on any device."""

    up_name = "up_proj"
    down_name = "down_proj"

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False):
        super().__init__()
        self.activation = plain_activation(hidden_act)
        self.add_module(self.up_name, Linear(hidden_size, intermediate_size, bias=bias))
        self.add_module(self.down_name, Linear(intermediate_size, hidden_size, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.down_name)(self.activation(getattr(self, self.up_name)(x)))
