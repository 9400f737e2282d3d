"""The Triton kernel of ``zoo::route_topk``: a token's routing in one program, after the router's logits.

    scores  = softmax(logits) or sigmoid(logits), float32            [E]
    choice  = scores + correction bias                                (to choose only)
    groups  : each group's best choice, or its two best summed; the topk_groups best groups kept,
              the other groups' experts out of the choice
    top-k   : k times the largest remaining choice (the lowest id among equals), its score the weight
    weights : renormalised (divided by their sum, or by renormalize_min where the sum is smaller), times the
              scaling factor

One program per token holds all E scores (E up to ``ops_cuda.router.ROUTER_KERNEL_MAX_EXPERTS``); every
shape depends on N, E and k only, so the op runs under CUDA-graph capture.
"""

import torch
import triton
import triton.language as tl

from ops_cuda.triton_helpers import begin_after_previous, pdl_launch


@triton.jit
def _best(values, index, BLOCK: tl.constexpr):
    # The largest value of a vector and its lowest index among equals.
    top = tl.max(values, 0)
    return tl.min(tl.where(values == top, index, BLOCK), 0)


@triton.jit
def _choice_keys(values, index, BLOCK: tl.constexpr):
    # One int64 per float32 value, ordered as the values are and, among equals, the lower index first:
    # the float's bits made to order as signed integers, above BLOCK - 1 - index. The largest key is the
    # best choice, found by one max reduction where `_best` takes two.
    bits = values.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (BLOCK - 1 - index).to(tl.int64)


@triton.jit
def _key_value(key):
    # The float32 value a key of `_choice_keys` was made from.
    ordered = (key >> 32).to(tl.int32)
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _route_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, group_size, logits_stride, scaling_factor,
    renormalize_min, TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, GROUP_TOP2: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    if HAS_BIAS:  # a parameter, read before waiting for the logits
        bias = tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
    begin_after_previous(PDL)
    logits = tl.load(logits_ptr + token * logits_stride + experts, mask=valid, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        exps = tl.exp(logits - tl.max(logits, 0))  # padding: exp(-inf) = 0
        scores = exps / tl.sum(exps, 0)
    else:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    choice = scores
    if HAS_BIAS:
        choice += bias
    choice = tl.where(valid, choice, float("-inf"))
    if NUM_GROUPS > 1:
        groups = tl.arange(0, BLOCK_G)
        member = ((experts[None, :] // group_size) == groups[:, None]) & valid[None, :]  # [BLOCK_G, BLOCK_E]
        in_group = tl.where(member, choice[None, :], float("-inf"))
        group_scores = tl.max(in_group, 1)
        if GROUP_TOP2:  # the best again with the best's expert left out: the second best
            first = tl.min(tl.where(in_group == group_scores[:, None], experts[None, :], BLOCK_E), 1)
            group_scores += tl.max(tl.where(experts[None, :] == first[:, None], float("-inf"), in_group), 1)
        group_scores = tl.where(groups < NUM_GROUPS, group_scores, float("-inf"))
        kept = tl.zeros([BLOCK_G], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUPS):
            group = _best(group_scores, groups, BLOCK_G)
            kept = tl.where(groups == group, 1, kept)
            group_scores = tl.where(groups == group, float("-inf"), group_scores)
        kept_expert = tl.sum(tl.where(member, kept[:, None], 0), 0) > 0
        choice = tl.where(kept_expert, choice, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    keys = _choice_keys(choice, experts, BLOCK_E)
    last = tl.min(keys, 0)  # a picked expert's key from then on: no expert left to pick is below it
    for k in tl.static_range(TOP_K):
        key = tl.max(keys, 0)
        expert = BLOCK_E - 1 - (key & 0xFFFFFFFF)
        picked = experts == expert
        if HAS_BIAS:  # the weight is the score, without the bias the choice took
            weight = tl.sum(tl.where(picked, scores, 0.0), 0)
        else:
            weight = _key_value(key)
        weights = tl.where(slots == k, weight, weights)
        ids = tl.where(slots == k, expert, ids)
        keys = tl.where(picked, last, keys)
    if RENORMALIZE:
        weights = weights / tl.maximum(tl.sum(weights, 0), renormalize_min)  # slots past k hold zero
    weights = weights * scaling_factor
    tl.store(weights_ptr + token * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, ids, mask=slots < TOP_K)


def route_topk_triton(
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
    """``zoo::route_topk`` on options ``layers.TopKRouter`` has checked."""
    num_tokens, num_experts = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    bias = correction_bias.contiguous() if correction_bias is not None else logits
    # One warp reduces by shuffles alone; a group-limited router's [groups, experts] tiles run faster on two.
    _route_topk_kernel[(num_tokens,)](
        logits, bias, weights, ids, num_experts, num_experts // num_groups, logits.stride(0), float(scaling_factor),
        float(renormalize_min), TOP_K=top_k, SOFTMAX=scoring == "softmax", HAS_BIAS=correction_bias is not None,
        NUM_GROUPS=num_groups, TOPK_GROUPS=topk_groups, GROUP_TOP2=group_score == "top2_sum", RENORMALIZE=renormalize,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_G=triton.next_power_of_2(num_groups),
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=1 if num_groups == 1 else 2, **pdl_launch(logits),
    )
    return weights, ids
