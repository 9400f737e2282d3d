"""Mixture-of-experts: every token through the gated MLPs of the experts its router picked.

Experts are stacked as HuggingFace transformers 5 stores them: ``gate_up [E, 2 * I, H]`` (gate rows
first, then up) and ``down [E, H, I]``. A token's output is the sum over its top-k experts of
``weight * down_e(act(gate_e(x)) * up_e(x))``.

On CUDA the op runs grouped GEMMs (``ops_cuda/moe_cuda.py``): bf16 on sm90/sm100 with H and I multiples of
8; other dtypes, devices and shapes run the reference below, whose grouped form reads the expert loads on
the host and so under CUDA-graph capture switches to its dense form.
"""

import torch
import torch.nn.functional as F

from ops_cuda.activation import act_and_mul_reference


def moe_experts_reference(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    # hidden [N, H], topk_weights [N, K], topk_ids [N, K] -> [N, H].
    # The (token, slot) pairs are grouped by expert; each expert that has tokens runs one pair of
    # matmuls over its group. Contributions are weighted and summed in float32, expert by expert.
    # Group sizes are data-dependent (read on the host), so under CUDA-graph capture the dense form runs.
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        return moe_experts_dense_reference(hidden, topk_weights, topk_ids, gate_up, down, activation)
    num_experts, top_k = gate_up.shape[0], topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)  # pair indices, grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    weights = topk_weights.reshape(-1, 1).to(torch.float32)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        h = act_and_mul_reference(F.linear(hidden[tokens], gate_up[expert]), activation)
        out.index_add_(0, tokens, F.linear(h, down[expert]).to(torch.float32) * weights[pairs])
    return out.to(hidden.dtype)


def moe_experts_dense_reference(hidden, topk_weights, topk_ids, gate_up, down, activation) -> torch.Tensor:
    """Every expert over every token, weighted by zero where the token did not pick it: static shapes
    (capturable in a CUDA graph) at num_experts / top_k times the work. Same sums, in the same order."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    weights = topk_weights.to(torch.float32)
    for expert in range(gate_up.shape[0]):
        weight = torch.where(topk_ids == expert, weights, 0.0).sum(dim=-1, keepdim=True)  # [N, 1]
        h = act_and_mul_reference(F.linear(hidden, gate_up[expert]), activation)
        out += F.linear(h, down[expert]).to(torch.float32) * weight
    return out.to(hidden.dtype)


@torch.library.custom_op("zoo::moe_experts", mutates_args=())
def moe_experts(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    return moe_experts_reference(hidden, topk_weights, topk_ids, gate_up, down, activation)


@moe_experts.register_fake
def _(hidden, topk_weights, topk_ids, gate_up, down, activation):
    return torch.empty_like(hidden)


@moe_experts.register_kernel("cuda")
def _(hidden, topk_weights, topk_ids, gate_up, down, activation):
    # triton (and the grouped-GEMM path) are imported only where a kernel runs
    from ops_cuda.moe_cuda import grouped_mm_supported, moe_experts_grouped_mm

    if not grouped_mm_supported(hidden, gate_up, down):
        # torch._grouped_mm's fast kernel is bf16-only (sm90/sm100) and needs 16-byte-aligned rows; for
        # anything else it loops over the groups after copying the offsets to the host, which is what
        # the reference does already (and the reference has a capturable dense form).
        return moe_experts_reference(hidden, topk_weights, topk_ids, gate_up, down, activation)
    return moe_experts_grouped_mm(hidden, topk_weights, topk_ids, gate_up, down, activation)
