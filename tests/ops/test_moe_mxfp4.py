"""``zoo::mxfp4_moe_experts``: MXFP4 experts (``ops_cuda/mxfp4.py``) through the op's reference, which
dequantises the picked experts, and through the Triton fused-MoE kernel reading blocks and scales
(``ops_cuda/moe_triton.py``), against ``zoo::moe_experts`` over the dequantised experts.

Without a GPU the kernel runs in Triton's interpreter (float32 and float16, whose tl.dot the
interpreter computes right) on tiny experts; the ``gpu`` tests run bfloat16 at gpt-oss-20b's expert shapes
(H = 2,880: a partial K-step of 128) for 1 to 4,096 tokens, and under CUDA-graph capture."""

import random

import pytest
import torch

from ops_cuda.moe import moe_experts_reference, mxfp4_moe_experts
from ops_cuda.mxfp4 import E2M1_VALUES, dequantise_mxfp4
from tests.conftest import every_pair, relative_error

NUM_EXPERTS = 8
HELD = [1, 4, 6]  # the experts of one rank under expert parallelism


def random_mxfp4(shape, seed, device="cpu"):
    """Random MXFP4 weight of ``shape`` [..., rows, columns]: (blocks, scales), every code equally likely,
    scales around 2^-4 (a few hundred values a row keep each product of order one)."""
    g = torch.Generator().manual_seed(seed)
    *outer, columns = shape
    blocks = torch.randint(0, 256, (*outer, columns // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 125, (*outer, columns // 32), generator=g, dtype=torch.uint8)
    return blocks.to(device), scales.to(device)


def mxfp4_experts(hidden_size, intermediate, device="cpu", seed=0):
    gate_up = random_mxfp4((NUM_EXPERTS, 2 * intermediate, hidden_size), seed, device)
    down = random_mxfp4((NUM_EXPERTS, hidden_size, intermediate), seed + 1, device)
    return (*gate_up, *down)


def biases(hidden_size, intermediate, dtype, device="cpu"):
    g = torch.Generator().manual_seed(7)
    return (torch.randn(NUM_EXPERTS, 2 * intermediate, generator=g).to(device, dtype),
            torch.randn(NUM_EXPERTS, hidden_size, generator=g).to(device, dtype))


def routed(num_tokens, top_k, allowed, seed=0, device="cpu"):
    rng = random.Random(seed)
    ids = torch.tensor([rng.sample(allowed, top_k) for _ in range(num_tokens)], dtype=torch.int64)
    weights = torch.randn(num_tokens, top_k, generator=torch.Generator().manual_seed(seed)).softmax(-1)
    return weights.to(device), ids.to(device)


def dequantised_reference(hidden, weights, ids, experts, activation, *expert_biases):
    gate_up_blocks, gate_up_scales, down_blocks, down_scales = experts
    gate_up = dequantise_mxfp4(gate_up_blocks, gate_up_scales, hidden.dtype)
    down = dequantise_mxfp4(down_blocks, down_scales, hidden.dtype)
    return moe_experts_reference(hidden, weights, ids, gate_up, down, activation, *expert_biases)


def test_dequantised_values_are_the_e2m1_table_times_the_scales():
    codes = torch.arange(16, dtype=torch.uint8)
    blocks = (codes | (codes.flip(0) << 4)).reshape(1, 16)  # byte j: code j, then code 15 - j
    scales = torch.tensor([[129]], dtype=torch.uint8)  # 2^2
    values = dequantise_mxfp4(blocks, scales, torch.float32)[0]
    table = torch.tensor(E2M1_VALUES)
    assert torch.equal(values[0::2], 4 * table) and torch.equal(values[1::2], 4 * table.flip(0))


@pytest.mark.parametrize("held", [None, HELD], ids=["all", "expert_parallel"])
def test_reference_equals_moe_experts_over_the_dequantised_experts(held):
    """Only the picked experts are dequantised, in id order: the same sums as over all of them. Ids of
    experts this rank does not hold (-1) add nothing."""
    experts = mxfp4_experts(64, 32)
    hidden = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    weights, ids = routed(9, 2, [1, 2, 4, 6], seed=4)
    if held is not None:
        ids = torch.where(torch.isin(ids, torch.tensor(held)), ids, -1)
    expected = dequantised_reference(hidden, weights, ids, experts, "silu", *biases(64, 32, torch.float32))
    ours = mxfp4_moe_experts(hidden, weights, ids, *experts, "silu", *biases(64, 32, torch.float32))
    assert torch.equal(ours, expected)


def test_blocks_and_scales_that_disagree_are_refused():
    gate_up_blocks, gate_up_scales, down_blocks, down_scales = mxfp4_experts(64, 32)
    hidden, (weights, ids) = torch.randn(2, 64), routed(2, 2, [0, 1])
    with pytest.raises(ValueError, match=r"gate_up blocks of shape \(8, 64, 32\) with scales of shape \(8, 64, 1\)"):
        mxfp4_moe_experts(hidden, weights, ids, gate_up_blocks, gate_up_scales[..., :1], down_blocks, down_scales,
                          "silu")
    wider_down = random_mxfp4((NUM_EXPERTS, 64, 64), seed=5)  # I = 64 where gate_up has I = 32
    with pytest.raises(ValueError, match=r"down blocks of shape \[E, H, I / 2\] = \(8, 64, 16\), got \(8, 64, 32\)"):
        mxfp4_moe_experts(hidden, weights, ids, gate_up_blocks, gate_up_scales, *wider_down, "silu")


# name -> (tokens, top_k, experts the routing may pick)
CASES = {
    "one_token": (1, 2, list(range(8))),
    "uneven": (11, 2, [0, 2, 3, 6]),
    "large_tiles": (70, 2, [0, 1, 3, 4, 6]),  # 140 pairs > 16 per expert: the 64-row blocks
}
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.interpreter
@pytest.mark.parametrize(("case", "dtype", "math"), every_pair(CASES, TOL, ("silu", "gpt_oss")), ids=str)
def test_kernel_matches_the_dequantised_experts_interpreted(case, dtype, math):
    """The interpreter's K-steps of 32 columns (a scale group): over H = 160 five, over I = 64 two; the gpu
    tests' H = 2,880 ends mid-step. Each case with each dtype, the math alternating: every pair of the
    three choices in half their combinations."""
    from ops_cuda.moe_triton import Mxfp4Scales, moe_experts_triton

    tokens, top_k, allowed = CASES[case]
    hidden_size, intermediate = 160, 64
    experts = mxfp4_experts(hidden_size, intermediate)
    activation, expert_biases = ("silu", ()) if math == "silu" else ("clamped_swiglu", biases(160, 64, dtype))
    hidden = torch.randn(tokens, hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    weights, ids = routed(tokens, top_k, allowed, seed=2)
    gate_up_blocks, gate_up_scales, down_blocks, down_scales = experts
    ours = moe_experts_triton(hidden, weights, ids, gate_up_blocks, down_blocks, activation, *expert_biases,
                              mxfp4=Mxfp4Scales(gate_up_scales, down_scales))
    expected = dequantised_reference(hidden, weights, ids, experts, activation, *expert_biases)
    assert ours.dtype == expected.dtype
    assert relative_error(ours, expected) <= TOL[dtype]


@pytest.mark.interpreter
@pytest.mark.parametrize(("top_k", "held", "dtype", "math"), [
    (4, None, torch.float32, "silu"),
    (4, HELD, torch.float16, "gpt_oss"),
    (3, None, torch.float16, "gpt_oss"),
    (3, HELD, torch.float32, "gpt_oss"),
    (3, HELD, torch.float16, "silu"),
], ids=["4-all-fp32-silu", "4-expert_parallel-fp16-gpt_oss", "3-all-fp16-gpt_oss", "3-expert_parallel-fp32-gpt_oss",
        "3-expert_parallel-fp16-silu"])
def test_one_token_kernels_match_the_dequantised_experts_interpreted(top_k, held, dtype, math):
    """A decode step's two launches (rows times the token on CUDA cores), K-steps of 32 values over H = 96
    and I = 64; ids of experts another rank holds (-1) add nothing; top-3 leaves the down kernel's fourth
    slot empty. The five cases hold every pair of the four choices (each case takes the interpreter
    several seconds). (bfloat16: the gpu tests.)"""
    from ops_cuda.moe_decode import moe_experts_mxfp4_token

    experts = mxfp4_experts(96, 64)
    activation, expert_biases = ("silu", ()) if math == "silu" else ("clamped_swiglu", biases(96, 64, dtype))
    hidden = torch.randn(1, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    weights, ids = routed(1, top_k, list(range(NUM_EXPERTS)), seed=2)
    if held is not None:
        ids = torch.where(torch.isin(ids, torch.tensor(held)), ids, -1)
    ours = moe_experts_mxfp4_token(hidden, weights, ids, *experts, activation, *expert_biases)
    expected = dequantised_reference(hidden, weights, ids, experts, activation, *expert_biases)
    assert ours.dtype == expected.dtype
    assert relative_error(ours, expected) <= TOL[dtype]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("columns", [96, 640])
def test_dequantising_kernel_gives_the_reference_values_interpreted(dtype, columns):
    """Rows of 12 words (96 values) in one 16-word tile, a partial one, or of 80 words in two 64-word
    tiles (the second partial); the values exact in both dtypes."""
    from ops_cuda.mxfp4_triton import dequantise_mxfp4_triton

    blocks, scales = random_mxfp4((3, 5, columns), seed=4)
    assert torch.equal(dequantise_mxfp4_triton(blocks, scales, dtype), dequantise_mxfp4(blocks, scales, dtype))


@pytest.mark.interpreter
@pytest.mark.parametrize("held", [None, HELD], ids=["all", "expert_parallel"])
def test_prompts_through_dequantised_chunks_match_the_reference_interpreted(held, monkeypatch):
    """A prompt's path: the experts dequantised three at a time (a last chunk of two), each chunk through
    moe_experts (here its reference) with the other chunks' ids -1, the chunks summed in float32."""
    import ops_cuda.moe as moe

    experts = mxfp4_experts(96, 64)
    monkeypatch.setattr(moe, "MXFP4_CHUNK_BYTES", 3 * 2 * (2 * 64 * 48 + 96 * 32) * 4)  # 3 experts' float32
    hidden = torch.randn(11, 96, generator=torch.Generator().manual_seed(1))
    weights, ids = routed(11, 3, list(range(NUM_EXPERTS)), seed=2)
    if held is not None:
        ids = torch.where(torch.isin(ids, torch.tensor(held)), ids, -1)
    expert_biases = biases(96, 64, torch.float32)
    ours = moe.mxfp4_through_dequantised_chunks(hidden, weights, ids, *experts, "clamped_swiglu", *expert_biases)
    expected = dequantised_reference(hidden, weights, ids, experts, "clamped_swiglu", *expert_biases)
    assert relative_error(ours, expected) <= TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 64, 300, 4096])
def test_bf16_gpt_oss_shapes_match_the_dequantised_experts_gpu(tokens):
    """gpt-oss-20b's experts (H = 2,880, I = 2,880, top-4 of 32 here 8), each path of the dispatch (one token's
    kernels, the fused-MoE kernel's MXFP4 tiles, dequantised chunks from 1,024 tokens on) against the float32
    computation, as close as zoo::moe_experts' CUDA kernels over the dequantised bf16 experts are."""
    from ops_cuda.moe import moe_experts

    experts = mxfp4_experts(2880, 2880, "cuda")
    expert_biases = biases(2880, 2880, torch.bfloat16, "cuda")
    hidden = torch.randn(tokens, 2880, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    weights, ids = routed(tokens, 4, list(range(NUM_EXPERTS)), seed=2, device="cuda")
    ours = mxfp4_moe_experts(hidden, weights, ids, *experts, "clamped_swiglu", *expert_biases)
    gate_up_blocks, gate_up_scales, down_blocks, down_scales = experts
    gate_up = dequantise_mxfp4(gate_up_blocks, gate_up_scales)
    down = dequantise_mxfp4(down_blocks, down_scales)
    bf16_kernels = moe_experts(hidden, weights, ids, gate_up, down, "clamped_swiglu", *expert_biases)
    expected = moe_experts_reference(hidden.float(), weights, ids, gate_up.float(), down.float(), "clamped_swiglu",
                                     *(b.float() for b in expert_biases))
    assert relative_error(ours.float(), expected) <= max(1e-2, 1.5 * relative_error(bf16_kernels.float(), expected))


@pytest.mark.gpu
def test_dequantising_kernel_gives_the_reference_values_gpu():
    """bfloat16, the prompts' dtype, on gpt-oss-20b's gate_up rows (360 words: six 64-word tiles, the last
    partial): exact."""
    from ops_cuda.mxfp4_triton import dequantise_mxfp4_triton

    blocks, scales = random_mxfp4((4, 5760, 2880), seed=4, device="cuda")
    ours = dequantise_mxfp4_triton(blocks, scales, torch.bfloat16)
    assert torch.equal(ours, dequantise_mxfp4(blocks, scales, torch.bfloat16))


@pytest.mark.gpu
def test_replays_in_a_cuda_graph_gpu():
    experts = mxfp4_experts(2880, 2880, "cuda")
    hidden = torch.randn(1, 2880, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    weights, ids = routed(1, 4, list(range(NUM_EXPERTS)), seed=2, device="cuda")
    eager = mxfp4_moe_experts(hidden, weights, ids, *experts, "clamped_swiglu")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mxfp4_moe_experts(hidden, weights, ids, *experts, "clamped_swiglu")
    ids.copy_(torch.tensor([[7, 5, 3, 1]], device="cuda"))
    graph.replay()
    assert torch.equal(captured, mxfp4_moe_experts(hidden, weights, ids, *experts, "clamped_swiglu"))
    assert not torch.equal(captured, eager)
