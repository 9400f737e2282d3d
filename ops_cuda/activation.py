"""Gated activations on a fused [..., 2 * d] input holding gate then up: act(gate) * up, or a form that
combines the two otherwise (GPT-OSS's clamped SwiGLU)."""

import math

import torch
import torch.nn.functional as F

from ops_cuda.clamped_swiglu import clamped_swiglu
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


def _times_up(activation):
    return lambda gate, up: activation(gate) * up


# The names act_and_mul takes -> the gated form f(gate, up): act(gate) * up for each of ``ACTIVATIONS``,
# and the forms that use gate and up otherwise.
GATED_ACTIVATIONS = {
    **{name: _times_up(activation) for name, activation in ACTIVATIONS.items()},
    "clamped_swiglu": clamped_swiglu,
}


def act_and_mul_reference(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The gated form ``activation`` (a key of ``GATED_ACTIVATIONS``) of x [..., 2 * d] holding gate then up:
    act(gate) * up, or GPT-OSS's clamped SwiGLU."""
    gate, up = x.chunk(2, dim=-1)
    return GATED_ACTIVATIONS[activation](gate, up)


act_and_mul_op = torch.library.custom_op("zoo::act_and_mul", act_and_mul_reference, mutates_args=())


@act_and_mul_op.register_fake
def _(x, activation):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@cuda_implementation(act_and_mul_op)
def _(x, activation):
    from ops_cuda.triton_kernels import act_and_mul_triton  # triton is imported only where a kernel runs

    return act_and_mul_triton(x, activation)


act_and_mul = public_op(act_and_mul_op, act_and_mul_reference)
