"""Mixture-of-experts blocks, with HuggingFace transformers 5's module paths:

    mlp.gate                                  router: a linear [E, H] -> softmax -> top-k
    mlp.experts.gate_up_proj [E, 2 * I, H]    the experts' gate and up projections, stacked
    mlp.experts.down_proj    [E, H, I]        the experts' down projections, stacked
    mlp.experts.gate_up_proj_bias [E, 2 * I]  optional: the experts' biases (GPT-OSS)
    mlp.experts.down_proj_bias    [E, H]
    mlp.gate.e_score_correction_bias          optional: DeepSeek's bias on the scores that choose the experts
    mlp.shared_expert, mlp.shared_expert_gate optional: a dense expert every token takes, gated by a sigmoid (Qwen2-MoE)
    mlp.shared_experts                        optional: dense experts every token takes, ungated (DeepSeek)

The experts' math is the ``zoo::moe_experts`` op, the router's after its linear layer ``zoo::route_topk``;
the shared expert is a plain layer, except that FP8 experts take DeepSeek's into their op
(``Experts.takes_shared``). Their tensor- and expert-parallel forms are in ``layers/parallel.py``.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from layers.linear import Linear
from layers.mlp import GatedMLP
from layers.norm import NormedRow, RowProduct
from layers.weights import OneOf, Shard
from ops_cuda import (GATED_ACTIVATIONS, fp8_moe_experts, moe_experts, mxfp4_moe_experts, normed_gemv,
                      normed_moe_experts, normed_moe_experts_into_norm, route_topk)
from ops_cuda.clamped_swiglu import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT  # noqa: F401 (for the models)
from ops_cuda.linear import linear


class TopKRouter(nn.Module):
    """Scores every expert, picks each token's top-k, and weighs them.

    ``scoring="softmax"`` (Qwen, Mixtral): softmax(x W^T) in float32, its top-k, renormalised to sum
    to one when ``renormalize`` (Qwen's ``norm_topk_prob``); Mixtral's top-k of the logits followed
    by a softmax over those k is the renormalised case.

    ``scoring="sigmoid"`` (DeepSeek-V3): sigmoid(x W^T) in float32. With ``score_correction_bias``,
    a learned per-expert bias (HF's ``e_score_correction_bias``) is added to the scores to choose
    the experts only; the weights are the scores themselves.

    With ``num_groups`` > 1 (group-limited top-k, DeepSeek-V2 and V3), the logits are taken in
    float32 and the experts come from the ``topk_groups`` groups that score highest, a group scored
    by its best expert (``group_score="max"``, V2) or its two best summed (``"top2_sum"``, V3).

    Either way the weights are then renormalised when ``renormalize`` (divided by their sum, or by
    ``renormalize_min`` where the sum is smaller: ERNIE 4.5's ``moe_norm_min``) and multiplied by
    ``scaling_factor`` (DeepSeek's ``routed_scaling_factor``). All of it after the linear layer is the
    op ``zoo::route_topk`` (one Triton kernel on CUDA).

    The logits are taken in float32 wherever the scores are more than a softmax of them, as HF's
    DeepSeek and GLM routers take them; ``model_dtype_logits`` keeps them in the model's dtype
    (MiniMax-M2's sigmoid router), the scores still computed from them in float32. ``bias`` adds a
    learned bias to the logits (GPT-OSS's router, a softmax over the top-k logits: the renormalised
    case).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool, scoring: str = "softmax",
                 score_correction_bias: bool = False, num_groups: int = 1, topk_groups: int = 1,
                 group_score: str = "top2_sum", scaling_factor: float = 1.0, model_dtype_logits: bool = False,
                 bias: bool = False, renormalize_min: float = 0.0):
        super().__init__()
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported router scoring {scoring!r}; supported: softmax, sigmoid")
        if num_experts % num_groups or not 0 < topk_groups <= num_groups:
            raise ValueError(f"n_group={num_groups} must divide the {num_experts} experts and topk_group={topk_groups} "
                             f"must be in [1, n_group]")
        group_size = num_experts // num_groups
        if not 0 < top_k <= group_size * topk_groups:
            choosable = (f"num_experts={num_experts}" if num_groups == 1 else
                         f"the {group_size * topk_groups} experts of topk_group={topk_groups} groups of {group_size}")
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, {choosable}]")
        if group_score not in ("top2_sum", "max"):
            raise ValueError(f"unsupported group_score {group_score!r}; supported: top2_sum, max")
        if num_groups > 1 and group_score == "top2_sum" and group_size < 2:  # ranked by its two best experts
            raise ValueError(f"n_group={num_groups} leaves fewer than 2 of the {num_experts} experts in a group")
        self.top_k, self.renormalize, self.scoring = top_k, renormalize, scoring
        self.num_groups, self.topk_groups, self.group_score = num_groups, topk_groups, group_score
        self.scaling_factor, self.renormalize_min = scaling_factor, renormalize_min
        self.model_dtype_logits = model_dtype_logits
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias else None
        if score_correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def empty_parameter(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Storage for a parameter when the loader materialises it: the score correction bias stays in
        float32 in a model of any dtype (as in HF), since the experts are chosen by it."""
        dtype = torch.float32 if name == "e_score_correction_bias" else dtype
        return torch.empty(getattr(self, name).shape, dtype=dtype, device=device)

    @property
    def plain_softmax(self) -> bool:
        """A softmax over all experts' scores, its logits in the model's dtype (Qwen's, Mixtral's)."""
        return self.scoring == "softmax" and self.num_groups == 1 and self.e_score_correction_bias is None

    def forward(self, x: torch.Tensor | NormedRow) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] float32, expert ids [N, k] int64). A split norm's row (``NormedRow``,
        which ``SparseMoE`` passes only to a plain softmax router) is read split."""
        if isinstance(x, NormedRow):
            logits = normed_gemv(x.weighted, x.stats, x.eps, self.weight, self.bias)
        else:
            in_model_dtype = self.plain_softmax or self.model_dtype_logits
            logits = linear(x, self.weight, self.bias, out_dtype=None if in_model_dtype else torch.float32)
        return route_topk(logits, self.e_score_correction_bias, self.top_k, self.scoring, self.renormalize,
                          self.num_groups, self.topk_groups, self.group_score, self.scaling_factor,
                          self.renormalize_min)

    def extra_repr(self) -> str:
        options = f"num_experts={self.weight.shape[0]}, top_k={self.top_k}, renormalize={self.renormalize}"
        if self.scoring != "softmax":
            options += f", scoring={self.scoring}"
        if self.num_groups > 1:
            options += f", num_groups={self.num_groups}, topk_groups={self.topk_groups}, group_score={self.group_score}"
        if self.renormalize_min:
            options += f", renormalize_min={self.renormalize_min}"
        if self.scaling_factor != 1.0:
            options += f", scaling_factor={self.scaling_factor}"
        if self.bias is not None:
            options += ", bias=True"
        return options


class Experts(nn.Module):
    """``num_experts`` gated MLPs stacked into two parameters.

    Checkpoints store them either per expert (``experts.{e}.gate_proj/up_proj/down_proj.weight``,
    the hub layout) or stacked (``experts.gate_up_proj``, ``experts.down_proj``, as transformers 5
    writes them with ``save_original_format=False``); both are declared and the loader takes the
    one the checkpoint has.

    With ``bias``, each projection has a bias per expert (GPT-OSS's): ``gate_up_proj_bias`` [E, 2 * I] (gate
    then up, as gate_up_proj's rows) and ``down_proj_bias`` [E, H], read from stacked tensors of those names.

    FP8 block-quantised experts kept in FP8 by the loader (as ``Linear``'s weight: float8_e4m3fn
    parameters, their scales in ``gate_up_proj_scale_inv`` and ``down_proj_scale_inv``, the block in
    ``fp8_block``) run through ``zoo::fp8_moe_experts``, which takes no biases.

    MXFP4 experts kept in MXFP4 by the loader (gpt-oss's; ``mxfp4`` true) hold uint8 blocks in
    ``gate_up_proj`` [E, 2 * I, H / 2] and ``down_proj`` [E, H, I / 2], their scales in
    ``gate_up_proj_scales`` and ``down_proj_scales`` (``ops_cuda/mxfp4.py``), and run through
    ``zoo::mxfp4_moe_experts``.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str,
                 bias: bool = False):
        super().__init__()
        if hidden_act not in GATED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: {sorted(GATED_ACTIVATIONS)}")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.hidden_act = hidden_act
        gate_up = torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size), requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.fp8_parameters = ("gate_up_proj", "down_proj")  # the loader's declaration: see loaders.load
        self.fp8_block: tuple[int, int] | None = None
        self.register_buffer("gate_up_proj_scale_inv", None)
        self.register_buffer("down_proj_scale_inv", None)
        self.mxfp4_parameters = ("gate_up_proj", "down_proj")  # the loader's declaration: see loaders.load
        self.mxfp4 = False
        self.register_buffer("gate_up_proj_scales", None)
        self.register_buffer("down_proj_scales", None)

    def checkpoint_shards(self, prefix: str) -> dict[str, OneOf]:
        size = self.intermediate_size
        gate, up = slice(0, size), slice(size, 2 * size)
        experts = range(self.num_experts)
        per_expert_gate_up = [
            Shard(f"{prefix}.{e}.{source}.weight", (e, rows)) for e in experts
            for source, rows in (("gate_proj", gate), ("up_proj", up))
        ]
        per_expert_down = [Shard(f"{prefix}.{e}.down_proj.weight", (e,)) for e in experts]
        shards = {
            "gate_up_proj": OneOf(per_expert_gate_up, [Shard(f"{prefix}.gate_up_proj")]),
            "down_proj": OneOf(per_expert_down, [Shard(f"{prefix}.down_proj")]),
        }
        if self.gate_up_proj_bias is not None:  # stacked, in zoo's layout
            shards["gate_up_proj_bias"] = [Shard(f"{prefix}.gate_up_proj_bias")]
            shards["down_proj_bias"] = [Shard(f"{prefix}.down_proj_bias")]
        return shards

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                shared: GatedMLP | None = None) -> torch.Tensor:
        """The routed experts' weighted sum; plus ``shared(x)``, which ``takes_shared`` must accept."""
        if shared is not None and not self.takes_shared(shared):
            raise ValueError(f"{type(self).__name__} cannot take this shared expert into its op: it takes an FP8 "
                             f"expert of its own shape, block and activation (see takes_shared)")
        if self.fp8_block is not None:
            if self.gate_up_proj_bias is not None:
                raise ValueError(f"{type(self).__name__}: FP8 experts with biases are not supported "
                                 "(zoo::fp8_moe_experts takes no biases)")
            shared_weights = () if shared is None else (
                shared.gate_up_proj.weight, shared.gate_up_proj.weight_scale_inv,
                shared.down_proj.weight, shared.down_proj.weight_scale_inv)
            return fp8_moe_experts(x, topk_weights, topk_ids, self.gate_up_proj, self.gate_up_proj_scale_inv,
                                   self.down_proj, self.down_proj_scale_inv, self.fp8_block, self.hidden_act,
                                   *shared_weights)
        if self.mxfp4:
            return mxfp4_moe_experts(x, topk_weights, topk_ids, self.gate_up_proj, self.gate_up_proj_scales,
                                     self.down_proj, self.down_proj_scales, self.hidden_act, self.gate_up_proj_bias,
                                     self.down_proj_bias)
        return moe_experts(x, topk_weights, topk_ids, self.gate_up_proj, self.down_proj, self.hidden_act,
                           self.gate_up_proj_bias, self.down_proj_bias)

    def takes_shared(self, shared: GatedMLP | None) -> bool:
        """Whether ``shared``, an ungated shared expert, runs inside these experts' op: FP8 experts and an
        FP8 expert of their shape, block and activation, without biases. At decode sizes its weights are
        then read in the experts' launch, as one more expert per token (``zoo::fp8_moe_experts``)."""
        if shared is None or self.fp8_block is None or shared.hidden_act != self.hidden_act:
            return False
        return all(linear.fp8_block == self.fp8_block and linear.bias is None and linear.weight.shape == stack.shape[1:]
                   for linear, stack in ((shared.gate_up_proj, self.gate_up_proj), (shared.down_proj, self.down_proj)))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, hidden_act={self.hidden_act}, "
                f"bias={self.gate_up_proj_bias is not None}" + (", mxfp4=True" if self.mxfp4 else ""))


@dataclass
class ExpertsRowProduct(RowProduct):
    """One token's experts after a split norm, left to the split norm after them
    (``zoo::normed_moe_experts_into_norm``): what a ``SparseMoE`` marked ``into_norm`` returns."""

    row: NormedRow
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    experts: Experts

    def into_norm(self, residual, norm_weight, stats):
        row, experts = self.row, self.experts
        return normed_moe_experts_into_norm(row.weighted, row.stats, row.eps, self.topk_weights, self.topk_ids,
                                            experts.gate_up_proj, experts.down_proj, experts.hidden_act,
                                            experts.gate_up_proj_bias, experts.down_proj_bias, residual, norm_weight,
                                            stats)


class SparseMoE(nn.Module):
    """A sparse MoE MLP: each token through its router's top-k experts, weighted; plus, when
    ``shared_expert_intermediate_size`` is given, ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``
    (Qwen2-MoE), or when ``shared_experts_intermediate_size`` is, ``shared_experts(x)`` ungated
    (DeepSeek; with biases where ``shared_experts_bias``, DeepSeek-V2's ``mlp_bias``). ``router_options``
    are ``TopKRouter``'s scoring options; ``expert_bias`` gives the experts biases (``Experts``' ``bias``).
    A subclass declares HF's name of its router (``router_name``: GPT-OSS's ``router``) and the classes of
    its router (``router_type``: ERNIE 4.5's, which declares its storage and layout) and of its experts
    (``experts_type``: one that declares a checkpoint layout of its own).

    Split over ranks (``layers.parallel.tensor_parallel``), each rank's experts and shared experts
    give a partial output and ``group`` is set: the block's one all-reduce sums the partial outputs."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        hidden_act: str,
        renormalize: bool,
        shared_expert_intermediate_size: int | None = None,
        shared_experts_intermediate_size: int | None = None,
        shared_experts_bias: bool = False,
        expert_bias: bool = False,
        **router_options,
    ):
        super().__init__()
        self.add_module(self.router_name, self.router_type(hidden_size, num_experts, top_k, renormalize,
                                                           **router_options))
        self.experts = self.experts_type(num_experts, hidden_size, intermediate_size, hidden_act, bias=expert_bias)
        if shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, hidden_act)
            self.shared_expert_gate = Linear(hidden_size, 1)
        else:
            self.shared_expert = self.shared_expert_gate = None
        if shared_experts_intermediate_size:
            self.shared_experts = GatedMLP(hidden_size, shared_experts_intermediate_size, hidden_act,
                                           bias=shared_experts_bias)
        else:
            self.shared_experts = None
        self.group = None
        self.into_norm = False  # DecoderModel.split_norms marks it: see split_norm_forward

    router_name = "gate"
    router_type = TopKRouter
    experts_type = Experts

    @property
    def reads_split_norm(self) -> bool:
        """Whether the RMSNorm before the block can be split between o_proj and it on a one-row step
        (``layers.norm.NormedRow``): a plain softmax router, the experts of ``Experts`` in the activations'
        dtype (neither FP8 nor MXFP4, which the loader sets), whole on this rank, and no shared expert.
        The router's logits and the experts' gate_up products then apply the norm's 1 / rms."""
        router, experts = getattr(self, self.router_name), self.experts
        return (type(router) is TopKRouter and router.plain_softmax and type(experts) is Experts
                and experts.fp8_block is None and not experts.mxfp4 and self.group is None
                and self.shared_expert is None and self.shared_experts is None)

    def forward(self, x: torch.Tensor | NormedRow) -> torch.Tensor | ExpertsRowProduct:
        if isinstance(x, NormedRow):
            return self.split_norm_forward(x)
        topk_weights, topk_ids = getattr(self, self.router_name)(x)
        if self.experts.takes_shared(self.shared_experts):
            out = self.experts(x, topk_weights, topk_ids, shared=self.shared_experts)
        else:
            out = self.experts(x, topk_weights, topk_ids)
            if self.shared_experts is not None:
                out = out + self.shared_experts(x)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.group is not None:
            dist.all_reduce(out, group=self.group)
        return out

    def split_norm_forward(self, x: NormedRow) -> torch.Tensor | ExpertsRowProduct:
        # One token's experts read the row split (their gate_up kernel applies the norm's 1 / rms);
        # weights of another dtype than the row's take the normalised row. Marked into_norm (the next
        # norm is split too), the experts are left to it: their down kernel adds the residual.
        experts = self.experts
        if not (x.takes(experts.gate_up_proj) and x.takes(getattr(self, self.router_name).weight)):
            return self(x.normalised())
        topk_weights, topk_ids = getattr(self, self.router_name)(x)
        if self.into_norm:
            return ExpertsRowProduct(x, topk_weights, topk_ids, experts)
        return normed_moe_experts(x.weighted, x.stats, x.eps, topk_weights, topk_ids, experts.gate_up_proj,
                                  experts.down_proj, experts.hidden_act, experts.gate_up_proj_bias,
                                  experts.down_proj_bias)
