"""The decode kernel of ``zoo::moe_experts`` (``ops_cuda/moe_decode.py``) against the op's PyTorch
reference, in Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1): tiny
experts in float32 and float16 (the interpreter's bfloat16 tl.dot is wrong), one token and several,
experts shared by several tokens, ids of -1 (experts on another rank), a token listing an expert twice,
a top-k that is not a power of two; each with the plain experts and with GPT-OSS's (biases, the clamped
SwiGLU). The bf16/fp16 GPU cases, CUDA-graph replay and the dispatch are in
``tests/ops/test_moe_gpu.py``.
"""

import pytest
import torch

pytest.importorskip("triton")

from ops_cuda.moe import (moe_experts_reference, normed_moe_experts_into_norm_reference,  # noqa: E402
                          normed_moe_experts_reference)
from ops_cuda.moe_decode import DECODE_MAX_TOKENS, TokenTiles, decode_supported, moe_experts_decode, \
    moe_experts_token_into_norm  # noqa: E402
from tests.conftest import every_pair  # noqa: E402
from tests.ops.test_moe_triton import MATH, TOL, assert_close, expert_math, experts  # noqa: E402

NUM_EXPERTS, HIDDEN, INTERMEDIATE = 8, 40, 24  # H and I: partial column and K tiles


def reference_skipping_missing(hidden, weights, ids, gate_up, down, activation, *biases):
    """The reference with each id of -1 (not on this rank) read as expert 0 at weight zero: what skipping it gives."""
    missing = ids < 0
    return moe_experts_reference(hidden, weights.masked_fill(missing, 0.0), ids.masked_fill(missing, 0), gate_up,
                                 down, activation, *biases)


def inputs(ids, dtype, seed=0, scale=1.0):
    ids = torch.tensor(ids, dtype=torch.int64)
    gate_up, down = experts(NUM_EXPERTS, HIDDEN, INTERMEDIATE, dtype, seed=seed)
    hidden = torch.randn(ids.shape[0], HIDDEN, generator=torch.Generator().manual_seed(seed + 1)) * scale
    hidden = hidden.to(dtype)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(seed + 2)).softmax(-1)
    return hidden, weights, ids, gate_up, down


# name -> topk ids [tokens, k] on NUM_EXPERTS experts
CASES = {
    "one_token": [[3, 0, 6, 1]],
    "one_token_top1": [[5]],
    "one_token_missing_experts": [[-1, 3, -1, 0]],
    "one_token_repeated_expert": [[2, 6, 2]],
    "shared_experts": [[1, 2], [2, 1], [1, 7], [7, 2], [2, 5]],  # expert 2 read once for four tokens
    "all_tokens_one_expert": [[4]] * 6,
    "missing_experts": [[-1, 3, -1, 0], [3, -1, -1, -1], [-1, -1, -1, -1], [0, 5, 3, -1]],  # a token with none
    "repeated_in_a_token": [[2, 2, 6], [6, 1, 6]],  # each listing counted, as the reference counts it
    "top3": [[0, 4, 7], [7, 6, 5], [1, 0, 4]],  # slots padded to 4
    "sixteen_tokens": [[(3 * t + j) % 8 for j in range(8)] for t in range(16)],  # 128 pairs, every expert
}


@pytest.mark.interpreter
@pytest.mark.parametrize(("case", "dtype", "math"), every_pair(CASES, TOL, list(MATH)), ids=str)
def test_matches_reference_interpreted(case, dtype, math):
    """Both forms: the one-token kernels (``one_token*``) and the kernels of several tokens. Each case
    with each dtype, the math alternating: every pair of the three choices in half their combinations."""
    activation, biases, scale = expert_math(math, NUM_EXPERTS, HIDDEN, INTERMEDIATE, dtype)
    args = inputs(CASES[case], dtype, scale=scale)
    ours = moe_experts_decode(*args, activation, *biases)
    # The kernels get the ids of -1 with their weights: a bias added for one would show.
    assert_close(ours, reference_skipping_missing(*args, activation, *biases), TOL[dtype])
    if case == "missing_experts":
        assert torch.equal(ours[2], torch.zeros(HIDDEN, dtype=dtype)), "a token with no expert here gives zeros"


@pytest.mark.interpreter
@pytest.mark.parametrize("tiles", [
    TokenTiles(gate_up_n=1, down_n=4, gate_up_k=64, down_k=32, num_warps=4),  # each row in one tile
    TokenTiles(gate_up_n=4, down_n=2, gate_up_k=32, down_k=8, num_warps=2),  # a partly masked last tile
], ids=["whole_rows", "masked_last_tile"])
def test_one_token_tilings_interpreted(tiles):
    args = inputs([[3, 0, 6, 1]], torch.float32, seed=5)
    assert_close(moe_experts_decode(*args, "silu", token_tiles=tiles), moe_experts_reference(*args, "silu"),
                 TOL[torch.float32])


@pytest.mark.interpreter
@pytest.mark.parametrize("activation", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_activations_interpreted(activation):
    hidden, weights, ids, gate_up, down = inputs([[0, 3], [3, 5], [6, 0]], torch.float32, seed=3)
    hidden = hidden * 3  # reach the activations' tails
    ours = moe_experts_decode(hidden, weights, ids, gate_up, down, activation)
    assert_close(ours, moe_experts_reference(hidden, weights, ids, gate_up, down, activation), TOL[torch.float32])


@pytest.mark.interpreter
def test_int32_ids_and_strided_hidden_interpreted():
    hidden, weights, ids, gate_up, down = inputs([[1, 4], [4, 0], [2, 1]], torch.float16, seed=4)
    strided = torch.cat([hidden, hidden], dim=1)[:, HIDDEN:]
    assert strided.stride(-1) == 1 and strided.stride(0) == 2 * HIDDEN
    ours = moe_experts_decode(strided, weights, ids.int(), gate_up, down, "silu")
    assert_close(ours, moe_experts_reference(hidden, weights, ids, gate_up, down, "silu"), TOL[torch.float16])


def test_supported_inputs():
    hidden, _, ids, gate_up, down = inputs([[1, 4]], torch.float16)
    assert decode_supported(hidden, ids, gate_up, down, "silu")
    assert not decode_supported(hidden, ids, gate_up, down, "tanh")  # no kernel formula
    assert not decode_supported(hidden.float(), ids, gate_up, down, "silu")  # mixed dtypes
    assert not decode_supported(hidden[:0], ids[:0], gate_up, down, "silu")  # no pairs
    many = hidden.expand(DECODE_MAX_TOKENS + 1, -1)
    assert decode_supported(many[:-1], ids.expand(DECODE_MAX_TOKENS, -1), gate_up, down, "silu")
    assert not decode_supported(many, ids.expand(DECODE_MAX_TOKENS + 1, -1), gate_up, down, "silu")
    assert not decode_supported(hidden, ids, gate_up[:, :-2], down, "silu")  # gate_up rows != 2 I


def split_norm_inputs(math, dtype):
    """One token's split-norm row (weighted, stats, eps), the experts' inputs and the normalised row."""
    activation, biases, scale = expert_math(math, NUM_EXPERTS, HIDDEN, INTERMEDIATE, dtype)
    _, weights, ids, gate_up, down = inputs([[3, 0, 6, 1]], dtype, seed=6, scale=scale)
    summed = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(7)) * 3
    norm_weight = 1 + 0.1 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(8))
    stats = torch.zeros(32, dtype=torch.float64)
    stats[[0, 5]] = summed.double().square().sum() / 2  # as two programs add it
    eps = 1e-6
    normalised = (summed * torch.rsqrt(summed.square().mean() + eps) * norm_weight).to(dtype)
    experts = (weights, ids, gate_up, down, activation, *biases)
    return (summed * norm_weight).to(dtype), stats, eps, experts, normalised


@pytest.mark.interpreter
@pytest.mark.parametrize("math", MATH)
@pytest.mark.parametrize("dtype", TOL, ids=["fp32", "fp16"])
def test_one_token_after_a_split_norm_interpreted(math, dtype):
    """``norm``: the hidden row is a split norm's weighted row, the slots hold its sum of squares."""
    weighted, stats, eps, experts, _ = split_norm_inputs(math, dtype)
    ours = moe_experts_decode(weighted, *experts, norm=(stats, eps))
    assert_close(ours, normed_moe_experts_reference(weighted, stats, eps, *experts), TOL[dtype])
    assert not torch.allclose(ours, moe_experts_reference(weighted, *experts), atol=1e-2), "the norm applied"


@pytest.mark.interpreter
@pytest.mark.parametrize("math", MATH)
@pytest.mark.parametrize("dtype", TOL, ids=["fp32", "fp16"])
def test_one_token_into_a_split_norm_interpreted(math, dtype):
    """``moe_experts_token_into_norm``: the experts' sum plus the residual, times the next norm's weight, its sum of
    squares added into the next norm's slots, as the reference (the experts, then the residual add)."""
    weighted, stats, eps, experts, _ = split_norm_inputs(math, dtype)
    generator = torch.Generator().manual_seed(9)
    residual = torch.randn(1, HIDDEN, generator=generator).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(HIDDEN, generator=generator)).to(dtype)
    ours_stats, expected_stats = torch.zeros(32, dtype=torch.float64), torch.zeros(32, dtype=torch.float64)
    with_biases = (*experts, None, None)[:7]  # silu's experts have none
    summed, ours_weighted = moe_experts_token_into_norm(weighted, *with_biases, (stats, eps),
                                                        (residual, norm_weight, ours_stats))
    expected_summed, expected_weighted = normed_moe_experts_into_norm_reference(
        weighted, stats, eps, *with_biases, residual, norm_weight, expected_stats)
    assert_close(summed, expected_summed, TOL[dtype])
    assert_close(ours_weighted, expected_weighted, TOL[dtype])
    assert ours_stats.count_nonzero() > 1  # each program adds its rows' squares into its own slot
    assert ours_stats.sum().item() == pytest.approx(summed.double().square().sum().item(), rel=1e-6)  # float32 sums
    assert ours_stats.sum().item() == pytest.approx(expected_stats.sum().item(), rel=TOL[dtype])


@pytest.mark.parametrize("math", MATH)
def test_split_norm_reference_is_the_experts_on_the_normalised_row(math):
    """In float32 (no rounding between the two forms): the experts on the norm's output."""
    weighted, stats, eps, experts, normalised = split_norm_inputs(math, torch.float32)
    assert_close(normed_moe_experts_reference(weighted, stats, eps, *experts),
                 moe_experts_reference(normalised, *experts), TOL[torch.float32])


def test_a_split_norm_is_one_tokens():
    hidden, weights, ids, gate_up, down = inputs([[1, 4], [4, 0]], torch.float32)
    with pytest.raises(ValueError, match="one token's: hidden has 2 tokens"):
        moe_experts_decode(hidden, weights, ids, gate_up, down, "silu",
                           norm=(torch.zeros(32, dtype=torch.float64), 1e-6))
    with pytest.raises(ValueError, match="one token: got 2"):
        normed_moe_experts_reference(hidden, torch.zeros(32, dtype=torch.float64), 1e-6, weights, ids, gate_up, down,
                                     "silu")
