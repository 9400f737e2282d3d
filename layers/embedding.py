"""Token embedding and the LM head (which may share the embedding's weight)."""

import torch
import torch.nn.functional as F
from torch import nn

from ops_cuda.linear import PackedWeight, linear


class VocabEmbedding(nn.Module):
    """The embedding rows of ``input_ids``, times ``scale`` when given (Gemma's ``sqrt(hidden_size)``).
    As in HuggingFace, the scale is rounded to the embedding's dtype before the multiply (in
    bfloat16 Gemma's sqrt(3072) = 55.43 becomes 55.5)."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.scale = scale
        if scale is not None:
            self.scale_in = {dtype: torch.tensor(scale, dtype=dtype, device="cpu").item()
                             for dtype in (torch.float32, torch.float16, torch.bfloat16)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeddings = F.embedding(input_ids, self.weight)
        if self.scale is None:
            return embeddings
        return embeddings * self.scale_in.get(embeddings.dtype, self.scale)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}" + (f", scale={self.scale}" if self.scale is not None else "")


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits. ``tie_to`` shares the embedding's weight; ``bias``
    adds a bias of the head's own (ERNIE 4.5 MoE's where ``use_bias``), tied or not."""

    def __init__(self, vocab_size: int, hidden_size: int, tie_to: VocabEmbedding | None = None, bias: bool = False):
        super().__init__()
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(vocab_size), requires_grad=False) if bias else None
        self.packed: PackedWeight | None = None  # see layers.linear.pack_cpu_weights

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return linear(hidden_states, self.weight, self.bias, packed=self.packed)
