"""Gated activations: act(gate) * up on a fused [..., 2 * d] input."""

import math

import torch
import torch.nn.functional as F

from ops_cuda.dispatch import cuda_implementation, public_op


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # HuggingFace's "gelu_new" spells the tanh approximation out; keep its exact formula.
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


# HuggingFace `hidden_act` names -> the function they denote.
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_new,
    "relu": F.relu,
}


def act_and_mul_reference(x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for x [..., 2 * d] holding gate then up; ``activation`` is a key of ``ACTIVATIONS``."""
    gate, up = x.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up


@torch.library.custom_op("zoo::act_and_mul", mutates_args=())
def act_and_mul_op(x: torch.Tensor, activation: str) -> torch.Tensor:
    return act_and_mul_reference(x, activation)


@act_and_mul_op.register_fake
def _(x, activation):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@cuda_implementation(act_and_mul_op)
def _(x, activation):
    from ops_cuda.triton_kernels import act_and_mul_triton  # triton is imported only where a kernel runs

    return act_and_mul_triton(x, activation)


act_and_mul = public_op(act_and_mul_op, act_and_mul_reference)
