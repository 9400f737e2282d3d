"""Mixture-of-experts blocks, with HuggingFace transformers 5's module paths:

    mlp.gate                                  router: a linear [E, H] -> softmax -> top-k
    mlp.experts.gate_up_proj [E, 2 * I, H]    the experts' gate and up projections, stacked
    mlp.experts.down_proj    [E, H, I]        the experts' down projections, stacked
    mlp.shared_expert, mlp.shared_expert_gate optional: a dense expert every token takes, gated by a sigmoid

The experts' math is the ``zoo::moe_experts`` op; the router and the shared expert are plain layers.
"""

import torch
import torch.nn.functional as F
from torch import nn

from layers.linear import Linear
from layers.mlp import GatedMLP
from layers.weights import OneOf, Shard
from ops_cuda import ACTIVATIONS, moe_experts


class TopKRouter(nn.Module):
    """softmax(x W^T) in float32, its top-k experts, and their weights, renormalised to sum to one
    when ``renormalize`` (Qwen's ``norm_topk_prob``). Mixtral's top-k of the logits followed by a
    softmax over those k is the renormalised case."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] float32, expert ids [N, k] int64)."""
        probs = F.linear(x, self.weight).softmax(dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def extra_repr(self) -> str:
        return f"num_experts={self.weight.shape[0]}, top_k={self.top_k}, renormalize={self.renormalize}"


class Experts(nn.Module):
    """``num_experts`` gated MLPs stacked into two parameters.

    Checkpoints store them either per expert (``experts.{e}.gate_proj/up_proj/down_proj.weight``,
    the hub layout) or stacked (``experts.gate_up_proj``, ``experts.down_proj``, as transformers 5
    writes them with ``save_original_format=False``); both are declared and the loader takes the
    one the checkpoint has.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str):
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: {sorted(ACTIVATIONS)}")
        self.num_experts, self.intermediate_size, self.hidden_act = num_experts, intermediate_size, hidden_act
        gate_up = torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)

    def checkpoint_shards(self, prefix: str) -> dict[str, OneOf]:
        size = self.intermediate_size
        gate, up = slice(0, size), slice(size, 2 * size)
        experts = range(self.num_experts)
        per_expert_gate_up = [
            Shard(f"{prefix}.{e}.{source}.weight", (e, rows)) for e in experts
            for source, rows in (("gate_proj", gate), ("up_proj", up))
        ]
        per_expert_down = [Shard(f"{prefix}.{e}.down_proj.weight", (e,)) for e in experts]
        return {
            "gate_up_proj": OneOf(per_expert_gate_up, [Shard(f"{prefix}.gate_up_proj")]),
            "down_proj": OneOf(per_expert_down, [Shard(f"{prefix}.down_proj")]),
        }

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return moe_experts(x, topk_weights, topk_ids, self.gate_up_proj, self.down_proj, self.hidden_act)

    def extra_repr(self) -> str:
        e, two_i, h = self.gate_up_proj.shape
        return f"num_experts={e}, hidden_size={h}, intermediate_size={two_i // 2}, hidden_act={self.hidden_act}"


class SparseMoE(nn.Module):
    """A sparse MoE MLP: each token through its router's top-k experts, weighted; plus, when
    ``shared_expert_intermediate_size`` is given, ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        hidden_act: str,
        renormalize: bool,
        shared_expert_intermediate_size: int | None = None,
    ):
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, renormalize)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, hidden_act)
        if shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, hidden_act)
            self.shared_expert_gate = Linear(hidden_size, 1)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
