"""GPT-OSS's gated form, the clamped SwiGLU: its constants (the config's ``swiglu_alpha`` and
``swiglu_limit``) and its PyTorch formula. ``act_and_mul`` takes it by name (``ops_cuda.activation``), and
the Triton kernels' form (``triton_helpers.clamped_swiglu``) reads the constants from here: a module of
its own, so that the kernels' helpers need not import the op that launches them."""

import torch

CLAMPED_SWIGLU_ALPHA = 1.702
CLAMPED_SWIGLU_LIMIT = 7.0


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """(up + 1) * gate * sigmoid(alpha * gate), gate clamped from above and up from both sides at the
    limit: HuggingFace's GptOssExperts._apply_gate, op by op in the tensors' dtype."""
    gate = gate.clamp(min=None, max=CLAMPED_SWIGLU_LIMIT)
    up = up.clamp(min=-CLAMPED_SWIGLU_LIMIT, max=CLAMPED_SWIGLU_LIMIT)
    glu = gate * torch.sigmoid(gate * CLAMPED_SWIGLU_ALPHA)
    return (up + 1) * glu
