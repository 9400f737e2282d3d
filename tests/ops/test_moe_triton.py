"""The Triton fused-MoE kernel of ``zoo::moe_experts`` (``ops_cuda/moe_triton.py``) against the op's
PyTorch reference.

Without a GPU the launcher runs on CPU tensors in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1): tiny experts (H=32, I=16..24) in float32 and float16 (the interpreter's bfloat16
tl.dot is wrong), both tile sizes, uneven loads, experts without tokens, runs that are not a multiple of
the block, GPT-OSS's experts (biases, the clamped SwiGLU), and the padded layout itself. On a GPU the
``gpu`` tests here check the layout and float32; the op-level GPU tests (bf16 and fp16 on Qwen3-30B-A3B
shapes, NaN-poisoned buffers, CUDA-graph replay) run both kernels of the dispatch, this one included, in
``tests/test_moe_gpu.py``.
"""

import random
import types

import pytest
import torch

pytest.importorskip("triton")

from ops_cuda.moe import (  # noqa: E402
    GROUPED_MM_MIN_PAIRS,
    cuda_kernel,
    moe_experts_dense_reference,
    moe_experts_reference,
)
import ops_cuda.moe_grouped_mm  # noqa: E402
from ops_cuda.moe_grouped_mm import moe_experts_grouped_mm  # noqa: E402
from ops_cuda.moe_triton import (  # noqa: E402
    INTERPRETER_TILES,
    LARGE_TILES,
    SMALL_TILES,
    max_blocks,
    moe_align,
    moe_experts_triton,
    tiles_for,
)


# Largest difference allowed, relative to the reference's largest magnitude. float32: the same math in
# another summation order. float16: both round the GEMM outputs and the activation to float16 at the same
# points; where one rounding falls the other way, a unit in the last place (2^-11 relative) propagates.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
NUM_EXPERTS, HIDDEN = 8, 32


def experts(num_experts, hidden_size, intermediate, dtype, device="cpu", seed=0):
    """gate_up [E, 2I, H], down [E, H, I] scaled so every intermediate is of order one."""
    g = torch.Generator(device=device).manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden_size, device=device, generator=g) / hidden_size**0.5
    down = torch.randn(num_experts, hidden_size, intermediate, device=device, generator=g) / intermediate**0.5
    return gate_up.to(dtype), down.to(dtype)


def expert_biases(num_experts, hidden_size, intermediate, dtype, device="cpu", seed=0):
    """gate_up_bias [E, 2I], down_bias [E, H] of order one, as GPT-OSS's experts have."""
    g = torch.Generator(device=device).manual_seed(seed + 100)
    gate_up_bias = torch.randn(num_experts, 2 * intermediate, device=device, generator=g)
    down_bias = torch.randn(num_experts, hidden_size, device=device, generator=g)
    return gate_up_bias.to(dtype), down_bias.to(dtype)


# The experts' math: name -> (activation, biased, scale of the hidden states). GPT-OSS's hidden states are
# scaled so that its gate and up values of ``experts``' weights pass the clamps at ±7.
MATH = {"silu": ("silu", False, 1.0), "gpt_oss": ("clamped_swiglu", True, 5.0)}


def expert_math(name, num_experts, hidden_size, intermediate, dtype, device="cpu"):
    """(activation, biases: () or (gate_up_bias, down_bias), hidden scale) of ``MATH[name]``."""
    activation, biased, scale = MATH[name]
    biases = expert_biases(num_experts, hidden_size, intermediate, dtype, device) if biased else ()
    return activation, biases, scale


def routed(num_tokens, top_k, allowed, seed=0, device="cpu"):
    """topk ids drawn only from ``allowed`` experts (distinct per token), and softmax weights (float32)."""
    rng = random.Random(seed)
    ids = torch.tensor([rng.sample(allowed, top_k) for _ in range(num_tokens)], dtype=torch.int64)
    weights = torch.randn(num_tokens, top_k, generator=torch.Generator().manual_seed(seed)).softmax(-1)
    return weights.to(device), ids.view(num_tokens, top_k).to(device)


def assert_close(ours, reference, tol):
    assert ours.shape == reference.shape and ours.dtype == reference.dtype
    error = (ours.float() - reference.float()).abs().max().item()
    assert error <= tol * reference.float().abs().max().item(), error


# name -> (tokens, top_k, experts the routing may pick) on NUM_EXPERTS experts
CASES = {
    "uneven": (11, 2, [0, 2, 3, 6]),  # 4 of 8 experts get no tokens, the others uneven runs
    "one_expert_17_rows": (17, 1, [5]),  # one run of 17 rows: a full block and one of a single row
    "last_expert_only": (3, 1, [7]),  # every run but the last empty
    "one_token": (1, 2, list(range(8))),  # a decode step
    "every_expert": (6, 4, list(range(8))),
    "large_tiles": (70, 2, [0, 1, 3, 4, 6]),  # 140 pairs > 16 per expert: the 64-row blocks
}


def check_layout(topk_ids, num_experts, block_m):
    layout = moe_align(topk_ids, num_experts, block_m)
    num_pairs = topk_ids.numel()
    row_pair, pair_row, block_expert = (t.cpu().long() for t in layout)
    expert_of_pair = topk_ids.reshape(-1).cpu().long()
    assert block_expert.shape[0] == max_blocks(num_pairs, num_experts, block_m)
    assert torch.equal(row_pair[pair_row], torch.arange(num_pairs)), "pair -> row -> pair is not the identity"
    if topk_ids.shape[0] == 1:  # one token: block p holds pair p alone, in slot order (no sort)
        assert torch.equal(block_expert, expert_of_pair) and torch.equal(pair_row, torch.arange(num_pairs) * block_m)
        return
    used = block_expert >= 0
    assert used.sum() == sum(-(-int(c) // block_m) for c in torch.bincount(expert_of_pair, minlength=num_experts))
    assert used[: used.sum()].all(), "unused blocks must come after every expert's blocks"
    assert (block_expert[used].diff() >= 0).all(), "blocks in expert order"
    for block in torch.nonzero(used).flatten().tolist():
        pairs = row_pair[block * block_m : (block + 1) * block_m]
        real = pairs[pairs < num_pairs]
        assert real.numel() > 0 and (expert_of_pair[real] == block_expert[block]).all()
        assert (pairs[real.numel() :] == num_pairs).all(), "padding only at the end of an expert's run"
        assert (real.diff() > 0).all(), "an expert's pairs in token order"


# ---------------------------------------------------------------------------------------------
# CPU: the launcher under Triton's interpreter
# ---------------------------------------------------------------------------------------------


def test_tiles_follow_the_rows_per_expert():
    on_gpu = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)  # tiles_for reads these two only
    assert tiles_for(on_gpu, 8, 128) == SMALL_TILES  # Qwen3-30B-A3B decode: 1 token x top-8
    assert tiles_for(on_gpu, 16 * 128, 128) == SMALL_TILES
    assert tiles_for(on_gpu, 16 * 128 + 1, 128) == LARGE_TILES
    float32_on_gpu = types.SimpleNamespace(is_cuda=True, dtype=torch.float32)
    assert tiles_for(float32_on_gpu, 8, 128) == SMALL_TILES._replace(block_k=SMALL_TILES.block_k // 2)
    assert tiles_for(torch.empty(0), 8, 128) == INTERPRETER_TILES[SMALL_TILES]


def test_dispatch_takes_biases_of_the_experts_dtype_and_shape(monkeypatch):
    """Biases in the experts' dtype and shape go to a kernel, but never the grouped GEMM (which would round
    each product before adding its bias; here made to take any experts); others to the reference, which
    raises where F.linear does."""
    monkeypatch.setattr(ops_cuda.moe_grouped_mm, "grouped_mm_supported", lambda hidden, gate_up, down: True)
    gate_up, down = experts(NUM_EXPERTS, HIDDEN, 16, torch.float16)
    gate_up_bias, down_bias = expert_biases(NUM_EXPERTS, HIDDEN, 16, torch.float16)
    few, many = torch.randn(2, HIDDEN).half(), torch.randn(GROUPED_MM_MIN_PAIRS, HIDDEN).half()
    few_ids, many_ids = routed(2, 2, list(range(8)))[1], routed(len(many), 1, list(range(8)))[1]
    assert cuda_kernel(few, few_ids, gate_up, down, "clamped_swiglu", gate_up_bias, down_bias) == "decode"
    assert cuda_kernel(few, few_ids, gate_up, down, "silu", None, down_bias) == "decode"
    assert cuda_kernel(many, many_ids, gate_up, down, "clamped_swiglu") == "grouped_mm"
    assert cuda_kernel(many, many_ids, gate_up, down, "clamped_swiglu", gate_up_bias, down_bias) == "triton"
    assert cuda_kernel(many, many_ids, gate_up, down, "silu", gate_up_bias) == "triton"
    assert cuda_kernel(few, few_ids, gate_up, down, "silu", gate_up_bias.float(), down_bias) == "reference"
    assert cuda_kernel(few, few_ids, gate_up, down, "silu", gate_up_bias, down_bias[:, :-1]) == "reference"


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES)
def test_layout_interpreted(case):
    tokens, top_k, allowed = CASES[case]
    block_m = tiles_for(torch.empty(0), tokens * top_k, NUM_EXPERTS).block_m
    check_layout(routed(tokens, top_k, allowed)[1], NUM_EXPERTS, block_m)


@pytest.mark.interpreter
def test_one_token_layout_keeps_slot_order_and_skipped_ids_interpreted():
    ids = torch.tensor([[5, 1, -1, 3]])  # slots out of expert order, one expert on another rank
    layout = moe_align(ids, NUM_EXPERTS, 16)
    assert layout.block_expert.tolist() == [5, 1, -1, 3]
    row_pair = layout.row_pair.view(4, 16)
    assert row_pair[:, 0].tolist() == [0, 1, 2, 3] and (row_pair[:, 1:] == 4).all()  # 4: padding
    assert layout.pair_row[[0, 1, 3]].tolist() == [0, 16, 48]
    gate_up, down = experts(NUM_EXPERTS, HIDDEN, 24, torch.float32)
    hidden = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(1))
    weights = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    expected = moe_experts_reference(hidden, weights.masked_fill(ids < 0, 0.0), ids.clamp(min=0), gate_up, down, "silu")
    assert_close(moe_experts_triton(hidden, weights, ids, gate_up, down, "silu"), expected, TOL[torch.float32])


@pytest.mark.interpreter
def test_layout_worst_case_fills_every_block_interpreted():
    # 8 pairs, 2 on each of 4 experts, blocks of 16: every expert pads 14 rows, all max_blocks blocks used.
    ids = torch.tensor([[0, 1], [2, 3], [3, 2], [1, 0]])
    assert max_blocks(8, 4, 16) == 4
    check_layout(ids, 4, 16)
    assert (moe_align(ids, 4, 16).block_expert == torch.arange(4, dtype=torch.int32)).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("math", MATH)
@pytest.mark.parametrize("dtype", TOL, ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_interpreted(case, dtype, math):
    tokens, top_k, allowed = CASES[case]
    gate_up, down = experts(NUM_EXPERTS, HIDDEN, 24, dtype)  # I = 24: a partial N tile
    activation, biases, scale = expert_math(math, NUM_EXPERTS, HIDDEN, 24, dtype)
    hidden = (torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1)) * scale).to(dtype)
    weights, ids = routed(tokens, top_k, allowed, seed=2)
    ours = moe_experts_triton(hidden, weights, ids, gate_up, down, activation, *biases)
    expected = moe_experts_reference(hidden, weights, ids, gate_up, down, activation, *biases)
    assert_close(ours, expected, TOL[dtype])


@pytest.mark.interpreter
@pytest.mark.parametrize("activation", ["gelu", "gelu_pytorch_tanh", "gelu_new", "relu"])
def test_activations_interpreted(activation):
    gate_up, down = experts(NUM_EXPERTS, HIDDEN, 16, torch.float32)
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1)) * 3  # reach the activations' tails
    weights, ids = routed(5, 2, list(range(8)), seed=3)
    ours = moe_experts_triton(hidden, weights, ids, gate_up, down, activation)
    assert_close(ours, moe_experts_reference(hidden, weights, ids, gate_up, down, activation), TOL[torch.float32])


@pytest.mark.interpreter
def test_int32_ids_strided_hidden_and_no_tokens_interpreted():
    gate_up, down = experts(NUM_EXPERTS, HIDDEN, 16, torch.float16)
    rows = torch.randn(9, 2 * HIDDEN, generator=torch.Generator().manual_seed(1)).half()
    hidden = rows[:, HIDDEN:]  # a strided view
    weights, ids = routed(9, 3, list(range(8)), seed=4)
    ours = moe_experts_triton(hidden, weights, ids.int(), gate_up, down, "silu")
    assert_close(ours, moe_experts_reference(hidden, weights, ids, gate_up, down, "silu"), TOL[torch.float16])
    empty = moe_experts_triton(hidden[:0], weights[:0], ids[:0], gate_up, down, "silu")
    assert empty.shape == (0, HIDDEN) and empty.dtype == torch.float16


def not_on_this_rank(ids, weights, held):
    """The ids of experts outside ``held`` replaced by -1 (expert parallelism), and what the op must
    equal: the original ids with those slots weighted zero."""
    skipped = ~torch.isin(ids, torch.tensor(held))
    return ids.masked_fill(skipped, -1), weights.masked_fill(skipped, 0.0)


@pytest.mark.parametrize("math", MATH)
def test_skipped_ids_add_nothing_in_the_references(math):
    """A pair of id -1 adds nothing, its expert's biases included."""
    gate_up, down = experts(NUM_EXPERTS, HIDDEN, 16, torch.float32)
    activation, biases, scale = expert_math(math, NUM_EXPERTS, HIDDEN, 16, torch.float32)
    hidden = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(1)) * scale
    weights, ids = routed(9, 3, list(range(8)), seed=5)
    local_ids, zeroed = not_on_this_rank(ids, weights, [0, 1, 2, 3])
    assert (local_ids == -1).any() and (local_ids >= 0).any()
    expected = moe_experts_reference(hidden, zeroed, ids, gate_up, down, activation, *biases)
    for reference in (moe_experts_reference, moe_experts_dense_reference):
        assert_close(reference(hidden, weights, local_ids, gate_up, down, activation, *biases), expected, 1e-6)
    none_held = torch.full_like(ids, -1)
    assert torch.equal(moe_experts_reference(hidden, weights, none_held, gate_up, down, activation, *biases),
                       torch.zeros_like(hidden))


@pytest.mark.interpreter
@pytest.mark.parametrize("math", MATH)
@pytest.mark.parametrize("held", [[0, 1, 2, 3], [4, 5, 6, 7], []], ids=["first_half", "second_half", "none"])
def test_skipped_ids_add_nothing_interpreted(held, math):
    """Ids of -1 get no row of the padded layout and add nothing (nor their expert's biases), in the
    fused-MoE kernel and in the grouped-GEMM path (its permute and combine kernels interpreted;
    torch._grouped_mm's CPU form), which the dispatch gives no biased experts."""
    gate_up, down = experts(NUM_EXPERTS, HIDDEN, 24, torch.float32)
    activation, biases, scale = expert_math(math, NUM_EXPERTS, HIDDEN, 24, torch.float32)
    hidden = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(1)) * scale
    weights, ids = routed(11, 2, list(range(8)), seed=6)
    local_ids, zeroed = not_on_this_rank(ids, weights, held)
    expected = moe_experts_reference(hidden, zeroed, ids, gate_up, down, activation, *biases)
    for kernel in (moe_experts_triton,) if biases else (moe_experts_triton, moe_experts_grouped_mm):
        ours = kernel(hidden, weights, local_ids, gate_up, down, activation, *biases)
        assert torch.isfinite(ours).all()
        assert_close(ours, expected, TOL[torch.float32])
    layout = moe_align(local_ids, NUM_EXPERTS, 16)
    held_pairs = torch.nonzero(local_ids.reshape(-1) >= 0).flatten()
    rows = layout.pair_row.long()[held_pairs]
    assert torch.equal(layout.row_pair.long()[rows], held_pairs)
    assert (layout.block_expert >= 0).sum() == sum(-(-int((local_ids == e).sum()) // 16) for e in held)


# ---------------------------------------------------------------------------------------------
# GPU: the compiled kernels (the op's bf16 / fp16 cases are in tests/test_moe_gpu.py)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 300, 4096])
def test_layout_gpu(tokens):
    """The Qwen3-30B-A3B routing shape (128 experts, top-8): a decode step, small and large tiles."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, 128, device="cuda", generator=g) + 2 * torch.randn(128, device="cuda", generator=g)
    ids = logits.topk(8, dim=-1).indices
    check_layout(ids, 128, tiles_for(logits.bfloat16(), ids.numel(), 128).block_m)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 37, 700])
def test_float32_matches_reference_gpu(tokens):
    """float32 multiplies in full float32 ("ieee", not TF32): the reference's math, in another order."""
    gate_up, down = experts(16, 256, 128, torch.float32, device="cuda")
    hidden = torch.randn(tokens, 256, device="cuda")
    weights, ids = routed(tokens, 4, [0, 2, 3, 6, 7, 11, 15], seed=tokens, device="cuda")  # 9 experts empty
    ours = moe_experts_triton(hidden, weights, ids, gate_up, down, "silu")
    assert_close(ours, moe_experts_reference(hidden, weights, ids, gate_up, down, "silu"), TOL[torch.float32])
