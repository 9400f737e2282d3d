"""Mixture-of-experts: every token through the gated MLPs of the experts its router picked.

Experts are stacked as HuggingFace transformers 5 stores them: ``gate_up [E, 2 * I, H]`` (gate rows
first, then up) and ``down [E, H, I]``, with optional biases (GPT-OSS's) ``gate_up_bias [E, 2 * I]`` and
``down_bias [E, H]``. A token's output is the sum over its top-k experts of
``weight * down_e(act(gate_e(x)) * up_e(x))`` (or another of ``ops_cuda.activation.GATED_ACTIVATIONS``),
each projection plus its expert's bias where there are biases. An id of -1 names an expert this rank does
not hold (expert parallelism, ``layers.parallel``): every path skips that slot, as if its weight were zero.

On CUDA, up to ``DECODE_MAX_PAIRS`` (token, slot) pairs in fp16/bf16 (a decode step) run the decode kernel
(``ops_cuda/moe_decode.py``): each picked expert's weights streamed once, no sort. More pairs are grouped by
expert, then run through one of two grouped-GEMM kernels, chosen by
the number of pairs (``GROUPED_MM_MIN_PAIRS``, set by measurement): the Triton fused-MoE kernel
(``ops_cuda/moe_triton.py``; fp16, bf16, fp32), which reads only the experts that have tokens, or PyTorch's
grouped GEMM (``ops_cuda/moe_grouped_mm.py``; bf16 on sm90/sm100 with H and I multiples of 8). Anything neither
takes runs the reference below, whose grouped form reads the expert loads on the host and so under
CUDA-graph capture switches to its dense form. Experts with biases skip the grouped GEMM (no bias in its
epilogue): the other kernels add each bias to the float32 product before rounding it, as ``F.linear`` does.

``zoo::fp8_moe_experts`` is the same with FP8 block-scaled experts (``ops_cuda/fp8.py``): its reference
dequantises them to the activation dtype; on CUDA the Triton fused-MoE kernel multiplies FP8 operands,
the activations quantised per token and group of ``block[1]`` columns. It also takes an ungated FP8
shared expert of the experts' shape (DeepSeek-V3's), added to their sum: in the fused-MoE launch up to
``SHARED_IN_LAUNCH_MAX_TOKENS`` tokens, through its own GEMMs beyond.

``zoo::normed_moe_experts`` is ``moe_experts`` for one token after a split RMSNorm (``ops_cuda/gemv.py``):
it takes the norm's weighted row and sums of squares, and the one-token gate_up kernel applies the norm's
1 / rms to its products, so the norm takes no launch of its own. ``zoo::normed_moe_experts_into_norm``
is it before the next split RMSNorm, as ``zoo::gemv_into_norm`` is ``gemv``: the down kernel adds the
residual, writes the norm's weighted row and adds the squares into its slots.

``zoo::mxfp4_moe_experts`` is the same with MXFP4 experts (``ops_cuda/mxfp4.py``: uint8 blocks of two
4-bit values a byte and a power-of-two scale per 32 values), gpt-oss's: its reference dequantises the
experts the tokens picked to the activation dtype; on CUDA the Triton fused-MoE kernel reads the blocks
and scales and multiplies in the activation dtype, each weight tile dequantised in registers, one token
(a batch-1 decode step) the two one-token kernels of ``ops_cuda/moe_decode.py``, rows times the token
on CUDA cores: a decode step reads about a quarter of the bytes of bf16 experts. From
``MXFP4_DEQUANTISE_MIN_TOKENS`` tokens on (prompts) the experts are dequantised into bf16 buffers a
chunk at a time and run through ``moe_experts``' kernels.
"""

import torch
import torch.nn.functional as F

from ops_cuda.activation import act_and_mul, act_and_mul_reference
from ops_cuda.dispatch import cuda_implementation, public_op
from ops_cuda.fp8 import check_block_weight, dequantise
from ops_cuda.fp8_linear import fp8_block_linear
from ops_cuda.gemv import into_norm_reference, normed_gemv_reference
from ops_cuda.mxfp4 import check_mxfp4_weight, dequantise_mxfp4


def moe_experts_reference(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """hidden [N, H] through the experts each token picked (topk_ids [N, K], -1 for none), weighted by
    topk_weights [N, K] and summed: [N, H]. ``gate_up_bias`` [E, 2 * I] and ``down_bias`` [E, H], in the
    experts' dtype: their biases, or None."""
    # The (token, slot) pairs are grouped by expert; each expert that has tokens runs one pair of
    # matmuls over its group. Contributions are weighted and summed in float32, expert by expert.
    # Group sizes are data-dependent (read on the host), so under CUDA-graph capture the dense form runs.
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        return moe_experts_dense_reference(hidden, topk_weights, topk_ids, gate_up, down, activation, gate_up_bias,
                                           down_bias)
    num_experts, top_k = gate_up.shape[0], topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)  # pair indices, grouped by expert, the skipped (-1) first
    skipped, *counts = torch.bincount(flat_ids + 1, minlength=num_experts + 1).tolist()
    weights = topk_weights.reshape(-1, 1).to(torch.float32)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    start = skipped
    for expert, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        h = act_and_mul_reference(F.linear(hidden[tokens], gate_up[expert], _bias_of(gate_up_bias, expert)),
                                  activation)
        y = F.linear(h, down[expert], _bias_of(down_bias, expert))
        out.index_add_(0, tokens, y.to(torch.float32) * weights[pairs])
    return out.to(hidden.dtype)


def ids_within(topk_ids: torch.Tensor, experts: slice) -> torch.Tensor:
    """``topk_ids`` of the ``experts`` range renumbered from 0, every other id -1 (which every path of the
    expert ops skips): a rank's experts under expert parallelism, a chunk of them."""
    local = topk_ids - experts.start
    return torch.where((local >= 0) & (local < experts.stop - experts.start), local, -1)


def biases_fit(dtype: torch.dtype | None, *biases_and_weights) -> bool:
    """Whether each (bias, weight) pair's bias is None or [E, rows of its weight] in ``dtype`` (None: the
    weight's own): as the kernels read an expert's bias."""
    return all(bias is None or (bias.dtype == (dtype or weight.dtype) and bias.shape == weight.shape[:2])
               for bias, weight in biases_and_weights)


def _bias_of(biases: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if biases is None else biases[expert]


def moe_experts_dense_reference(hidden, topk_weights, topk_ids, gate_up, down, activation, gate_up_bias=None,
                                down_bias=None) -> torch.Tensor:
    """Every expert over every token, weighted by zero where the token did not pick it (-1 matches no
    expert): static shapes (capturable in a CUDA graph) at num_experts / top_k times the work. Same
    sums, in the same order."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    weights = topk_weights.to(torch.float32)
    for expert in range(gate_up.shape[0]):
        weight = torch.where(topk_ids == expert, weights, 0.0).sum(dim=-1, keepdim=True)  # [N, 1]
        h = act_and_mul_reference(F.linear(hidden, gate_up[expert], _bias_of(gate_up_bias, expert)), activation)
        out += F.linear(h, down[expert], _bias_of(down_bias, expert)).to(torch.float32) * weight
    return out.to(hidden.dtype)


moe_experts_op = torch.library.custom_op("zoo::moe_experts", moe_experts_reference, mutates_args=())


@moe_experts_op.register_fake
def _(hidden, topk_weights, topk_ids, gate_up, down, activation, gate_up_bias=None, down_bias=None):
    return torch.empty_like(hidden)


# From this many (token, slot) pairs on, torch._grouped_mm's CUTLASS kernel runs the experts; below it the
# Triton fused-MoE kernel does, whose small tiles read only the active experts' weights (at batch-1 decode
# 8 of 128 experts on Qwen3-30B-A3B) where grouped_mm runs its 64-row tiles over every group.
# Measured on the H200 with `python3 benchmarks/bench_moe.py --task kernels` (2026-11-29, torch 2.11,
# triton 3.6; E=128, top-8, H=2048, I=768, bf16), µs triton / grouped_mm: 8 pairs 39.5 / 68.5,
# 128 pairs 104.5 / 150.8, 2048 pairs 252.4 / 246.4, 8192 pairs 358.2 / 423.6, 32768 pairs 1145 / 836.
# Triton wins or ties up to 8192 pairs and loses by 27% at 32768: the switch sits between the two.
GROUPED_MM_MIN_PAIRS = 16384
# Up to this many pairs, fp16/bf16, the decode kernel runs the experts: it reads each picked expert once
# and launches three kernels (gate_up, down, combine; a token alone two) where the fused-MoE kernel
# launches four or more (the pairs' layout, gate_up, down, combine). `python3 benchmarks/bench_moe.py
# --task kernels` (H200, triton 3.6, the shapes above, before a token alone took two launches), µs
# decode / triton: 8 pairs 29.4 / 40.1, 64 pairs 71.8 / 79.5, 128 pairs 87.9 / 90.5, 512 pairs
# 207.6 / 133.1: the decode kernel wins through 16 tokens of top-8.
DECODE_MAX_PAIRS = 128
DECODE_DTYPES = (torch.float16, torch.bfloat16)


def cuda_kernel(hidden, topk_ids, gate_up, down, activation, gate_up_bias=None, down_bias=None) -> str:
    """Which kernel the op's CUDA dispatch runs on these inputs: "decode", "grouped_mm", "triton" or
    "reference"."""
    # triton (and the grouped-GEMM path) are imported only where a kernel runs
    from ops_cuda.moe_decode import decode_supported
    from ops_cuda.moe_grouped_mm import grouped_mm_supported
    from ops_cuda.moe_triton import triton_supported

    if not biases_fit(None, (gate_up_bias, gate_up), (down_bias, down)):
        return "reference"
    if (topk_ids.numel() <= DECODE_MAX_PAIRS and hidden.dtype in DECODE_DTYPES
            and decode_supported(hidden, topk_ids, gate_up, down, activation)):
        return "decode"
    unbiased = gate_up_bias is None and down_bias is None  # torch._grouped_mm adds no bias before rounding
    if unbiased and topk_ids.numel() >= GROUPED_MM_MIN_PAIRS and grouped_mm_supported(hidden, gate_up, down):
        return "grouped_mm"
    if triton_supported(hidden, gate_up, down, activation):
        return "triton"
    return "reference"


@cuda_implementation(moe_experts_op)
def _(hidden, topk_weights, topk_ids, gate_up, down, activation, gate_up_bias=None, down_bias=None):
    from ops_cuda.moe_decode import moe_experts_decode
    from ops_cuda.moe_grouped_mm import moe_experts_grouped_mm
    from ops_cuda.moe_triton import moe_experts_triton

    kernel = cuda_kernel(hidden, topk_ids, gate_up, down, activation, gate_up_bias, down_bias)
    if kernel == "decode":
        return moe_experts_decode(hidden, topk_weights, topk_ids, gate_up, down, activation, gate_up_bias, down_bias)
    if kernel == "grouped_mm":
        return moe_experts_grouped_mm(hidden, topk_weights, topk_ids, gate_up, down, activation)
    if kernel == "triton":
        return moe_experts_triton(hidden, topk_weights, topk_ids, gate_up, down, activation, gate_up_bias, down_bias)
    # Other or mixed dtypes, unknown activations, biases of another dtype or shape: the reference (which raises
    # where F.linear or the lookup does).
    return moe_experts_reference(hidden, topk_weights, topk_ids, gate_up, down, activation, gate_up_bias, down_bias)


moe_experts = public_op(moe_experts_op, moe_experts_reference, reads_host=True)


def _one_token_kernels_take(weighted, topk_ids, gate_up, down, activation, gate_up_bias, down_bias) -> bool:
    # Whether a split norm's row goes through one token's two decode launches (ops_cuda.moe_decode),
    # which apply the norm; elsewhere the reference runs.
    from ops_cuda.moe_decode import one_token_supported

    return (one_token_supported(weighted, gate_up, down)
            and cuda_kernel(weighted, topk_ids, gate_up, down, activation, gate_up_bias, down_bias) == "decode")


def normed_moe_experts_reference(
    weighted: torch.Tensor,
    stats: torch.Tensor,
    eps: float,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``moe_experts`` for one token after a split RMSNorm (``ops_cuda.gemv``): ``weighted`` [1, H] is the
    norm's weighted row and ``stats`` holds its sum of squares; each expert's gate_up products are
    ``normed_gemv``'s (the weighted row's products times the norm's 1 / rms, plus the bias, rounded to
    the experts' dtype). The experts' outputs are weighted and summed in float32, slot by slot."""
    if weighted.shape[0] != 1:
        raise ValueError(f"zoo::normed_moe_experts takes a split norm's row, one token: got {weighted.shape[0]}")
    out = torch.zeros(weighted.shape, dtype=torch.float32, device=weighted.device)
    for slot, expert in enumerate(topk_ids[0].tolist()):
        if expert < 0:  # another rank's
            continue
        products = normed_gemv_reference(weighted, stats, eps, gate_up[expert], _bias_of(gate_up_bias, expert))
        y = F.linear(act_and_mul_reference(products, activation), down[expert], _bias_of(down_bias, expert))
        out += y.to(torch.float32) * topk_weights[0, slot].to(torch.float32)
    return out.to(weighted.dtype)


normed_moe_experts_op = torch.library.custom_op("zoo::normed_moe_experts", normed_moe_experts_reference,
                                                mutates_args=())


@normed_moe_experts_op.register_fake
def _(weighted, stats, eps, topk_weights, topk_ids, gate_up, down, activation, gate_up_bias=None, down_bias=None):
    return torch.empty_like(weighted)


@cuda_implementation(normed_moe_experts_op)
def _(weighted, stats, eps, topk_weights, topk_ids, gate_up, down, activation, gate_up_bias=None, down_bias=None):
    from ops_cuda.moe_decode import moe_experts_decode
    from ops_cuda.triton_kernels import check_norm_stats

    check_norm_stats("normed_moe_experts", stats)
    if _one_token_kernels_take(weighted, topk_ids, gate_up, down, activation, gate_up_bias, down_bias):
        return moe_experts_decode(weighted, topk_weights, topk_ids, gate_up, down, activation, gate_up_bias, down_bias,
                                  norm=(stats, eps))
    return normed_moe_experts_reference(weighted, stats, eps, topk_weights, topk_ids, gate_up, down, activation,
                                        gate_up_bias, down_bias)


normed_moe_experts = public_op(normed_moe_experts_op, normed_moe_experts_reference, reads_host=True)


def normed_moe_experts_into_norm_reference(
    weighted: torch.Tensor,
    stats: torch.Tensor,
    eps: float,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    next_stats: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``normed_moe_experts`` before a split RMSNorm, as ``zoo::gemv_into_norm`` is ``gemv``: returns (summed
    = the experts' sum + residual, weighted = summed * norm_weight) and adds summed's sum of squares
    into ``next_stats``."""
    out = normed_moe_experts_reference(weighted, stats, eps, topk_weights, topk_ids, gate_up, down, activation,
                                       gate_up_bias, down_bias)
    return into_norm_reference(out, residual, norm_weight, next_stats)


normed_moe_experts_into_norm_op = torch.library.custom_op(
    "zoo::normed_moe_experts_into_norm", normed_moe_experts_into_norm_reference, mutates_args=("next_stats",))


@normed_moe_experts_into_norm_op.register_fake
def _(weighted, stats, eps, topk_weights, topk_ids, gate_up, down, activation, gate_up_bias, down_bias, residual,
      norm_weight, next_stats):
    return torch.empty_like(residual), torch.empty_like(residual)


@cuda_implementation(normed_moe_experts_into_norm_op)
def _(weighted, stats, eps, topk_weights, topk_ids, gate_up, down, activation, gate_up_bias, down_bias, residual,
      norm_weight, next_stats):
    from ops_cuda.moe_decode import moe_experts_token_into_norm
    from ops_cuda.triton_helpers import check_dtypes
    from ops_cuda.triton_kernels import check_norm_stats

    check_norm_stats("normed_moe_experts_into_norm", stats)
    check_norm_stats("normed_moe_experts_into_norm", next_stats)
    check_dtypes("normed_moe_experts_into_norm", weighted, residual, norm_weight)
    if residual.shape != weighted.shape or norm_weight.shape != weighted.shape[1:]:
        raise ValueError(f"zoo::normed_moe_experts_into_norm adds a residual of the row's shape {tuple(weighted.shape)} "
                         f"into a norm of {weighted.shape[-1]}: got residual {tuple(residual.shape)}, norm weight "
                         f"{tuple(norm_weight.shape)}")
    if _one_token_kernels_take(weighted, topk_ids, gate_up, down, activation, gate_up_bias, down_bias):
        return moe_experts_token_into_norm(weighted, topk_weights, topk_ids, gate_up, down, activation, gate_up_bias,
                                           down_bias, (stats, eps),
                                           (residual.contiguous(), norm_weight.contiguous(), next_stats))
    return normed_moe_experts_into_norm_reference(weighted, stats, eps, topk_weights, topk_ids, gate_up, down,
                                                  activation, gate_up_bias, down_bias, residual, norm_weight,
                                                  next_stats)


normed_moe_experts_into_norm = public_op(normed_moe_experts_into_norm_op, normed_moe_experts_into_norm_reference,
                                         reads_host=True)


def fp8_moe_experts_reference(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale_inv: torch.Tensor,
    down: torch.Tensor,
    down_scale_inv: torch.Tensor,
    block: list[int],
    activation: str,
    shared_gate_up: torch.Tensor | None = None,
    shared_gate_up_scale_inv: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    shared_down_scale_inv: torch.Tensor | None = None,
) -> torch.Tensor:
    """``moe_experts`` with float8_e4m3fn experts ``gate_up`` [E, 2 * I, H] and ``down`` [E, H, I], each
    with float32 scales per ``block`` of its last two dimensions, dequantised to hidden's dtype.

    With the ``shared_*`` tensors, an ungated FP8 expert of the same shape and block that every token
    takes (DeepSeek's ``shared_experts``): its output added to the experts' sum, both in hidden's dtype,
    as the model adds them."""
    check_block_weight("fp8_moe_experts", gate_up, gate_up_scale_inv, block)
    check_block_weight("fp8_moe_experts", down, down_scale_inv, block)
    shared = _checked_shared(gate_up, down, block, shared_gate_up, shared_gate_up_scale_inv, shared_down,
                             shared_down_scale_inv)
    gate_up = dequantise(gate_up, gate_up_scale_inv, block).to(hidden.dtype)
    down = dequantise(down, down_scale_inv, block).to(hidden.dtype)
    out = moe_experts_reference(hidden, topk_weights, topk_ids, gate_up, down, activation)
    if shared is None:
        return out
    shared_gate_up, shared_down = (dequantise(weight, scale_inv, block).to(hidden.dtype)
                                   for weight, scale_inv in ((shared[0], shared[1]), (shared[2], shared[3])))
    return out + F.linear(act_and_mul_reference(F.linear(hidden, shared_gate_up), activation), shared_down)


def _checked_shared(gate_up, down, block, *shared) -> tuple | None:
    # The shared expert's four tensors, all or none, each of one expert's shape.
    if all(tensor is None for tensor in shared):
        return None
    if any(tensor is None for tensor in shared):
        raise ValueError("zoo::fp8_moe_experts: a shared expert takes all four of shared_gate_up, "
                         "shared_gate_up_scale_inv, shared_down and shared_down_scale_inv")
    for (weight, scale_inv), experts in zip((shared[:2], shared[2:]), (gate_up, down), strict=True):
        check_block_weight("fp8_moe_experts", weight, scale_inv, block)
        if weight.shape != experts.shape[1:]:
            raise ValueError(f"zoo::fp8_moe_experts: a shared expert weight of shape {tuple(weight.shape)} for "
                             f"experts of shape {tuple(experts.shape)}: it must be one expert's {tuple(experts.shape[1:])}")
    return shared


# Up to this many tokens the shared expert runs as one more pair per token in the fused-MoE launch:
# faster there up to 32 tokens, as fast at 64, slower from 128 on than its own GEMMs
# (`bench_fp8.py --task moe`, DeepSeek-V3's shapes).
SHARED_IN_LAUNCH_MAX_TOKENS = 32


fp8_moe_experts_op = torch.library.custom_op("zoo::fp8_moe_experts", fp8_moe_experts_reference, mutates_args=())


@fp8_moe_experts_op.register_fake
def _(hidden, topk_weights, topk_ids, gate_up, gate_up_scale_inv, down, down_scale_inv, block, activation,
      shared_gate_up=None, shared_gate_up_scale_inv=None, shared_down=None, shared_down_scale_inv=None):
    return torch.empty_like(hidden)


@cuda_implementation(fp8_moe_experts_op)
def _(hidden, topk_weights, topk_ids, gate_up, gate_up_scale_inv, down, down_scale_inv, block, activation,
      shared_gate_up=None, shared_gate_up_scale_inv=None, shared_down=None, shared_down_scale_inv=None):
    from ops_cuda.moe_triton import Fp8Scales, SharedExpert, moe_experts_triton, shared_supported, triton_supported

    check_block_weight("fp8_moe_experts", gate_up, gate_up_scale_inv, block)
    check_block_weight("fp8_moe_experts", down, down_scale_inv, block)
    shared = _checked_shared(gate_up, down, block, shared_gate_up, shared_gate_up_scale_inv, shared_down,
                             shared_down_scale_inv)
    scales = Fp8Scales(gate_up_scale_inv, down_scale_inv, tuple(block))
    if not triton_supported(hidden, gate_up, down, activation, scales):
        return fp8_moe_experts_reference(hidden, topk_weights, topk_ids, gate_up, gate_up_scale_inv, down,
                                         down_scale_inv, block, activation, *(shared or ()))
    if shared is not None:
        shared = SharedExpert(gate_up=shared[0], down=shared[2], gate_up_scale=shared[1], down_scale=shared[3])
        if hidden.shape[0] <= SHARED_IN_LAUNCH_MAX_TOKENS and shared_supported(shared, gate_up, down, scales):
            return moe_experts_triton(hidden, topk_weights, topk_ids, gate_up, down, activation, fp8=scales,
                                      shared=shared)
    out = moe_experts_triton(hidden, topk_weights, topk_ids, gate_up, down, activation, fp8=scales)
    if shared is None:
        return out
    h = act_and_mul(fp8_block_linear(hidden, shared.gate_up, shared.gate_up_scale, block, None), activation)
    return out + fp8_block_linear(h, shared.down, shared.down_scale, block, None)


fp8_moe_experts = public_op(fp8_moe_experts_op, fp8_moe_experts_reference, reads_host=True)


def mxfp4_moe_experts_reference(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_blocks: torch.Tensor,
    gate_up_scales: torch.Tensor,
    down_blocks: torch.Tensor,
    down_scales: torch.Tensor,
    activation: str,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``moe_experts`` with MXFP4 experts (``ops_cuda/mxfp4.py``): gate_up [E, 2 * I, H] as blocks
    [E, 2 * I, H / 2] and scales [E, 2 * I, H / 32], down [E, H, I] as [E, H, I / 2] and [E, H, I / 32].
    The experts the tokens picked are dequantised to hidden's dtype (all of them under CUDA-graph
    capture, where which were picked cannot be read)."""
    _check_mxfp4_experts(gate_up_blocks, gate_up_scales, down_blocks, down_scales)
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        picked, ids = slice(None), topk_ids
    else:
        picked = topk_ids[topk_ids >= 0].unique()
        position = torch.full((gate_up_blocks.shape[0],), -1, dtype=topk_ids.dtype, device=topk_ids.device)
        position[picked] = torch.arange(picked.numel(), dtype=topk_ids.dtype, device=topk_ids.device)
        ids = torch.where(topk_ids >= 0, position[topk_ids.clamp(min=0)], -1)
    gate_up = dequantise_mxfp4(gate_up_blocks[picked], gate_up_scales[picked], hidden.dtype)
    down = dequantise_mxfp4(down_blocks[picked], down_scales[picked], hidden.dtype)
    return moe_experts_reference(hidden, topk_weights, ids, gate_up, down, activation,
                                 None if gate_up_bias is None else gate_up_bias[picked],
                                 None if down_bias is None else down_bias[picked])


def _check_mxfp4_experts(gate_up_blocks, gate_up_scales, down_blocks, down_scales) -> None:
    check_mxfp4_weight("mxfp4_moe_experts", "gate_up", gate_up_blocks, gate_up_scales)
    check_mxfp4_weight("mxfp4_moe_experts", "down", down_blocks, down_scales)
    experts, two_i, half_h = gate_up_blocks.shape
    if down_blocks.shape != (experts, 2 * half_h, two_i // 4):
        raise ValueError(f"zoo::mxfp4_moe_experts: gate_up blocks of shape {tuple(gate_up_blocks.shape)} "
                         f"([E, 2 * I, H / 2]) need down blocks of shape [E, H, I / 2] = "
                         f"{(experts, 2 * half_h, two_i // 4)}, got {tuple(down_blocks.shape)}")


mxfp4_moe_experts_op = torch.library.custom_op("zoo::mxfp4_moe_experts", mxfp4_moe_experts_reference, mutates_args=())


@mxfp4_moe_experts_op.register_fake
def _(hidden, topk_weights, topk_ids, gate_up_blocks, gate_up_scales, down_blocks, down_scales, activation,
      gate_up_bias=None, down_bias=None):
    return torch.empty_like(hidden)


# From this many tokens on, MXFP4 experts are dequantised into bf16 buffers a chunk of experts at a time
# and run through zoo::moe_experts' kernels: at prompt sizes each weight tile would be dequantised once per
# block of rows inside the fused-MoE kernel, where the buffer dequantises it once. A chunk of experts
# holds at most MXFP4_CHUNK_BYTES dequantised. Measured on an H100 at gpt-oss-20b's experts (top-4 of
# 32, a probe, not kept), µs per layer, fused-MoE MXFP4 tiles / dequantised chunks: 256 tokens 798 /
# 1563, 1,024 tokens 1,787 / 1,836, 4,096 tokens 5,533 / 3,877 (bf16 experts: 605, 859, 2,878).
MXFP4_DEQUANTISE_MIN_TOKENS = 1024
MXFP4_CHUNK_BYTES = 1 << 30


def mxfp4_through_dequantised_chunks(hidden, topk_weights, topk_ids, gate_up_blocks, gate_up_scales, down_blocks,
                                     down_scales, activation, gate_up_bias=None, down_bias=None) -> torch.Tensor:
    """``zoo::mxfp4_moe_experts`` as ``moe_experts`` over the experts dequantised a chunk at a time (the
    ids of other chunks' experts -1 in each), the chunks' outputs summed in float32."""
    from ops_cuda.mxfp4_triton import dequantise_mxfp4_triton

    num_experts = gate_up_blocks.shape[0]
    expert_bytes = 2 * (gate_up_blocks[0].numel() + down_blocks[0].numel()) * hidden.element_size()
    chunk = max(1, min(num_experts, MXFP4_CHUNK_BYTES // expert_bytes))
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for first in range(0, num_experts, chunk):
        experts = slice(first, min(first + chunk, num_experts))
        ids = ids_within(topk_ids, experts)
        gate_up = dequantise_mxfp4_triton(gate_up_blocks[experts], gate_up_scales[experts], hidden.dtype)
        down = dequantise_mxfp4_triton(down_blocks[experts], down_scales[experts], hidden.dtype)
        out += moe_experts(hidden, topk_weights, ids, gate_up, down, activation,
                           None if gate_up_bias is None else gate_up_bias[experts],
                           None if down_bias is None else down_bias[experts]).float()
    return out.to(hidden.dtype)


@cuda_implementation(mxfp4_moe_experts_op)
def _(hidden, topk_weights, topk_ids, gate_up_blocks, gate_up_scales, down_blocks, down_scales, activation,
      gate_up_bias=None, down_bias=None):
    from ops_cuda.moe_decode import moe_experts_mxfp4_token
    from ops_cuda.moe_triton import Mxfp4Scales, moe_experts_triton, mxfp4_triton_supported

    _check_mxfp4_experts(gate_up_blocks, gate_up_scales, down_blocks, down_scales)
    scales = Mxfp4Scales(gate_up_scales, down_scales)
    biases_ok = biases_fit(hidden.dtype, (gate_up_bias, gate_up_blocks), (down_bias, down_blocks))
    if not (biases_ok and mxfp4_triton_supported(hidden, gate_up_blocks, down_blocks, activation, scales)):
        return mxfp4_moe_experts_reference(hidden, topk_weights, topk_ids, gate_up_blocks, gate_up_scales,
                                           down_blocks, down_scales, activation, gate_up_bias, down_bias)
    if hidden.shape[0] == 1:  # a decode step: rows times the token on CUDA cores, two launches
        return moe_experts_mxfp4_token(hidden, topk_weights, topk_ids, gate_up_blocks, gate_up_scales, down_blocks,
                                       down_scales, activation, gate_up_bias, down_bias)
    if hidden.shape[0] >= MXFP4_DEQUANTISE_MIN_TOKENS:
        return mxfp4_through_dequantised_chunks(hidden, topk_weights, topk_ids, gate_up_blocks, gate_up_scales,
                                                down_blocks, down_scales, activation, gate_up_bias, down_bias)
    return moe_experts_triton(hidden, topk_weights, topk_ids, gate_up_blocks, down_blocks, activation, gate_up_bias,
                              down_bias, mxfp4=scales)


mxfp4_moe_experts = public_op(mxfp4_moe_experts_op, mxfp4_moe_experts_reference, reads_host=True)
