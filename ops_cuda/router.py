"""Mixture-of-experts routing after the router's logits: scores, each token's top-k experts, their weights.

``zoo::route_topk`` takes the logits [N, E] of the router's linear layer and gives (weights [N, k]
float32, ids [N, k] int64). Its options are ``layers.TopKRouter``'s (which checks them):

- ``scoring``: "softmax" (Qwen, Mixtral) or "sigmoid" (DeepSeek-V3) of the logits, in float32;
- ``correction_bias`` [E] (float32): added to the scores to choose the experts only (DeepSeek-V3's
  ``e_score_correction_bias``); the weights are the scores themselves;
- ``num_groups`` > 1: group-limited top-k (DeepSeek-V2/V3): the experts come from the ``topk_groups``
  groups that score highest, a group scored by its best expert (``group_score="max"``) or its two best
  summed (``"top2_sum"``);
- ``renormalize``: the k weights divided by their sum, or by ``renormalize_min`` where the sum is smaller
  (ERNIE 4.5's ``moe_norm_min``; 0 by default: the sum); then multiplied by ``scaling_factor``.

On CUDA a Triton kernel (``ops_cuda/router_triton.py``) does all of it in one launch, a program per
token; the order of a token's k ids may differ from the reference's where it does not sort them.
"""

import torch

from ops_cuda.dispatch import cuda_implementation, public_op

# The CUDA kernel takes up to this many experts (one program holds a token's scores); more run the reference.
ROUTER_KERNEL_MAX_EXPERTS = 1024
# Whether the op's CUDA dispatch runs the Triton kernel (the benchmarks turn it off to time the reference).
ROUTER_KERNEL = True


def route_topk_reference(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    scoring: str,
    renormalize: bool,
    num_groups: int,
    topk_groups: int,
    group_score: str,
    scaling_factor: float,
    renormalize_min: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, k] float32, expert ids [N, k] int64)."""
    if scoring == "softmax" and num_groups == 1 and correction_bias is None:
        weights, ids = logits.softmax(dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
    else:
        logits = logits.float()
        scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
        ids = choose_experts(scores, correction_bias, top_k, num_groups, topk_groups, group_score)
        weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=renormalize_min)
    if scaling_factor != 1.0:
        weights = weights * scaling_factor
    return weights, ids


def choose_experts(scores: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, num_groups: int,
                   topk_groups: int, group_score: str) -> torch.Tensor:
    """The top-k experts of each token by the (bias-corrected, group-limited) scores [N, E]."""
    if correction_bias is not None:
        scores = scores + correction_bias
    if num_groups > 1:
        grouped = scores.view(scores.shape[0], num_groups, -1)
        if group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        best_groups = group_scores.topk(topk_groups, dim=-1, sorted=False)[1]
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        scores = grouped.masked_fill(~kept[..., None], float("-inf")).view_as(scores)
    return scores.topk(top_k, dim=-1, sorted=False)[1]


route_topk_op = torch.library.custom_op("zoo::route_topk", route_topk_reference, mutates_args=())


@route_topk_op.register_fake
def _(logits, correction_bias, top_k, scoring, renormalize, num_groups, topk_groups, group_score, scaling_factor,
      renormalize_min=0.0):
    shape = (logits.shape[0], top_k)
    return (logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64))


@cuda_implementation(route_topk_op)
def _(logits, correction_bias, top_k, scoring, renormalize, num_groups, topk_groups, group_score, scaling_factor,
      renormalize_min=0.0):
    if ROUTER_KERNEL and logits.dim() == 2 and logits.shape[1] <= ROUTER_KERNEL_MAX_EXPERTS:
        from ops_cuda.router_triton import route_topk_triton  # triton is imported only where a kernel runs

        return route_topk_triton(logits, correction_bias, top_k, scoring, renormalize, num_groups, topk_groups,
                                 group_score, scaling_factor, renormalize_min)
    return route_topk_reference(logits, correction_bias, top_k, scoring, renormalize, num_groups, topk_groups,
                                group_score, scaling_factor, renormalize_min)


route_topk = public_op(route_topk_op, route_topk_reference)
