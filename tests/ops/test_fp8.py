"""FP8 block-scaled weights: ``zoo::fp8_block_linear`` and ``zoo::fp8_moe_experts`` against
dequantise-then-matmul, the per-token-group quantisation of the activations, and the kernels.

On the CPU, where the ops are their references: against float64 products over weights dequantised
entry by entry (``dequantised_float64``, apart from ``ops_cuda.fp8.dequantise``); the quantisation's
defining properties (each group's scale, rounding to the nearest e4m3 value). Under ``TRITON_INTERPRET=1``:
the single-row kernel, the Triton block-FP8 GEMM and the FP8 fused-MoE kernel on tiny shapes (float32
and float16 activations; the interpreter's own cast to float8 is wrong, so the activations are
quantised by the PyTorch reference there). On the GPU (``gpu``): the quantisation kernel, the
single-row kernel and both GEMMs of the dispatch (Triton, and torch._scaled_mm's block-scaled kernel
where it runs) on DeepSeek-V3's shapes, the FP8 fused-MoE kernel, CUDA-graph replay, and a tiny FP8
DeepSeek-V3 checkpoint loaded on CUDA with its weights kept in FP8, against its dequantised twin.

Two oracles: the kernels' own arithmetic in PyTorch (activations quantised the same way, products in
float32: ``quantised_product``), which they must match up to summation order and the final
rounding; and the ops' references (dequantise, then matmul), which they match up to the activations'
quantisation (``QUANTISATION_TOL``). The single-row kernel quantises nothing: it must match the
reference itself up to summation order and rounding (``KERNEL_TOL``).
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from ops_cuda import fp8_block_linear, fp8_moe_experts
from ops_cuda.activation import act_and_mul_reference
from ops_cuda.fp8 import FP8_DTYPE, FP8_MAX, MIN_GROUP_MAX, dequantise, quantise_groups_reference
from ops_cuda.fp8_linear import fp8_block_linear_reference
from ops_cuda.moe import fp8_moe_experts_reference
from tests.loaders.test_fp8 import quantise
from tests.ops.test_moe_triton import routed

pytest.importorskip("triton")

from ops_cuda.fp8_triton import quantised_activations, quantised_product  # noqa: E402

# Largest difference from the op's reference, relative to the reference's largest magnitude. e4m3 keeps
# 3 mantissa bits: each activation is rounded to within 2^-4 of itself, and an output sums K such errors
# with random signs, about 2^-4 / sqrt(3) ~ 3.6% of the output's typical size; measured, at most 2-3% of
# the largest output. The fused MoE quantises twice (the hidden rows, then h): its errors add.
QUANTISATION_TOL = {"linear": 0.06, "moe": 0.1}
# Against ``quantised_product``: float32 in another summation order; float16 and bfloat16 round the
# output once more (2^-11, 2^-8 relative; with margin).
KERNEL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.float()
    return ((ours.float() - reference).abs().max() / reference.abs().max()).item()


def fp8_weight(out_features, in_features, block, device="cpu", leading=(), seed=0):
    """(fp8 weight, float32 scales) of a random [*leading, out, in] weight scaled to outputs of order one."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(*leading, out_features, in_features, generator=generator).to(device) / in_features**0.5
    # Quantised on the device: block by block on the CPU, under pytest-xdist's workers, DeepSeek's experts take minutes.
    fp8, scale_inv, _ = quantise(weight, block)
    return fp8, scale_inv


def quantised_moe(hidden, topk_weights, topk_ids, gate_up, gate_up_scale, down, down_scale, block, activation,
                  *shared):
    """The FP8 fused-MoE kernel's arithmetic pair by pair: the hidden row quantised, the gate and up
    products in float32 rounded to hidden's dtype, the activation and product as act_and_mul rounds,
    h quantised, the down product rounded, the weighted sum in float32. ``shared``: a shared expert's
    (gate_up, its scales, down, its scales), one more pair per token added to the sum rounded."""
    def expert_output(x, gate_up, down):
        h = act_and_mul_reference((x @ gate_up.t()).to(hidden.dtype), activation)
        return (quantised_activations(h, block[1]) @ down.t()).to(hidden.dtype)[0]

    gate_up, down = dequantise(gate_up, gate_up_scale, block), dequantise(down, down_scale, block)
    x = quantised_activations(hidden, block[1])
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for token in range(hidden.shape[0]):
        for slot in range(topk_ids.shape[1]):
            expert = topk_ids[token, slot]
            out[token] += topk_weights[token, slot] * expert_output(x[token : token + 1], gate_up[expert],
                                                                    down[expert]).float()
    if not shared:
        return out.to(hidden.dtype)
    shared_gate_up, shared_down = dequantise(*shared[:2], block), dequantise(*shared[2:], block)
    out = out.to(hidden.dtype)
    for token in range(hidden.shape[0]):
        out[token] += expert_output(x[token : token + 1], shared_gate_up, shared_down)
    return out


# ---------------------------------------------------------------------------------------------
# CPU: the references and the quantisation
# ---------------------------------------------------------------------------------------------


def dequantised_float64(weight: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """The FP8 weight [..., N, K] as float64, element by element: entry (n, k) times the scale of its
    block (n // block[0], k // block[1]). Written apart from ``ops_cuda.fp8.dequantise``, as its oracle."""
    rows, cols = weight.shape[-2:]
    row_blocks = torch.arange(rows) // block[0]
    col_blocks = torch.arange(cols) // block[1]
    return weight.double() * scale_inv.double()[..., row_blocks[:, None], col_blocks[None, :]]


def moe_float64(hidden, topk_weights, topk_ids, gate_up, down):
    """Each token's sum over its slots of weight * down_e(silu(gate_e(x)) * up_e(x)) in float64, pair by
    pair, over float64 experts gate_up [E, 2I, H] (gate rows, then up) and down [E, H, I]."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for token in range(hidden.shape[0]):
        for slot in range(topk_ids.shape[1]):
            expert = topk_ids[token, slot]
            gate, up = (gate_up[expert] @ hidden[token].double()).chunk(2)
            out[token] += topk_weights[token, slot].double() * (down[expert] @ (F.silu(gate) * up))
    return out


def test_dequantise_is_each_entry_times_its_blocks_scale():
    """Bit for bit ``dequantised_float64`` rounded to float32. Partial edge blocks in both dimensions,
    blocks that are not square over a square grid of 3 x 3 scales: swapped block sizes, a transposed
    grid or a block boundary one row or column off show."""
    weight, scale_inv = fp8_weight(72, 112, (32, 48), leading=(3,))
    expected = dequantised_float64(weight, scale_inv, (32, 48))
    # An FP8 entry (4 significant bits) times a float32 scale is exact in float64: float32's product is
    # that value rounded once.
    assert torch.equal(dequantise(weight, scale_inv, (32, 48)), expected.float())


def test_fp8_block_linear_is_the_dequantised_product():
    """The op and its reference against x W^T + b in float64 over the weight dequantised entry by
    entry (``dequantised_float64``): only float32's rounding apart."""
    torch.manual_seed(0)
    block = (32, 48)  # 72 x 112: partial edge blocks in both dimensions
    weight, scale_inv = fp8_weight(72, 112, block)
    x, bias = torch.randn(2, 3, 112), torch.randn(72)
    expected = x.double() @ dequantised_float64(weight, scale_inv, block).t() + bias.double()
    for ours in (fp8_block_linear(x, weight, scale_inv, block, bias),
                 torch.ops.zoo.fp8_block_linear(x, weight, scale_inv, list(block), bias)):
        assert ours.dtype == torch.float32 and ours.shape == (2, 3, 72)
        assert relative_error(ours, expected) <= 1e-5  # float32's sums
    # In bfloat16 the weight is dequantised (exactly, in float32) then rounded to bfloat16, as a
    # checkpoint dequantised on load is, and multiplied in bfloat16.
    weight_bf16 = dequantised_float64(weight, scale_inv, block).float().bfloat16()
    expected = F.linear(x.bfloat16(), weight_bf16)
    assert torch.equal(fp8_block_linear(x.bfloat16(), weight, scale_inv, block, None), expected)


def test_fp8_moe_experts_is_the_experts_on_the_dequantised_weights():
    """Against the routed sum in float64, pair by pair, over experts dequantised entry by entry."""
    torch.manual_seed(0)
    block = (16, 32)  # I = 20, H = 40: partial blocks in both dimensions of both weights
    gate_up, gate_up_scale = fp8_weight(2 * 20, 40, block, leading=(4,))
    down, down_scale = fp8_weight(40, 20, block, leading=(4,), seed=1)
    hidden = torch.randn(5, 40)
    weights, ids = routed(5, 2, [0, 1, 3])
    expected = moe_float64(hidden, weights, ids, dequantised_float64(gate_up, gate_up_scale, block),
                           dequantised_float64(down, down_scale, block))
    ours = fp8_moe_experts(hidden, weights, ids, gate_up, gate_up_scale, down, down_scale, block, "silu")
    assert ours.dtype == torch.float32 and ours.shape == hidden.shape
    assert relative_error(ours, expected) <= 1e-5  # float32's sums


def test_fp8_moe_experts_adds_the_shared_expert():
    """The routed sum plus the shared expert's output on every token: against float64 over weights
    dequantised entry by entry, within bfloat16's roundings; and, bit for bit, the two added in
    bfloat16 as the model adds them, the shared expert's weights dequantised to bfloat16."""
    torch.manual_seed(0)
    block = (16, 32)
    gate_up, gate_up_scale = fp8_weight(2 * 20, 40, block, leading=(4,))
    down, down_scale = fp8_weight(40, 20, block, leading=(4,), seed=1)
    shared = (*fp8_weight(2 * 20, 40, block, seed=2), *fp8_weight(40, 20, block, seed=3))
    hidden = torch.randn(5, 40).bfloat16()
    weights, ids = routed(5, 2, [0, 1, 3])
    ours = fp8_moe_experts(hidden, weights, ids, gate_up, gate_up_scale, down, down_scale, block, "silu", *shared)
    assert ours.dtype == torch.bfloat16 and ours.shape == hidden.shape
    shared_gate_up, shared_down = dequantised_float64(*shared[:2], block), dequantised_float64(*shared[2:], block)
    every_token = torch.ones(5, 1), torch.zeros(5, 1, dtype=torch.int64)  # the shared expert as expert 0 of one
    expected = (moe_float64(hidden, weights, ids, dequantised_float64(gate_up, gate_up_scale, block),
                            dequantised_float64(down, down_scale, block))
                + moe_float64(hidden, *every_token, shared_gate_up[None], shared_down[None]))
    assert relative_error(ours, expected) <= 3e-2  # bf16 weights, h and both sums: a few units of 2^-8
    routed_sum = fp8_moe_experts(hidden, weights, ids, gate_up, gate_up_scale, down, down_scale, block, "silu")
    h = act_and_mul_reference(F.linear(hidden, shared_gate_up.float().bfloat16()), "silu")
    assert torch.equal(ours, routed_sum + F.linear(h, shared_down.float().bfloat16()))
    with pytest.raises(ValueError, match="a shared expert takes all four of shared_gate_up"):
        fp8_moe_experts(hidden, weights, ids, gate_up, gate_up_scale, down, down_scale, block, "silu", *shared[:3], None)
    other, other_scale = fp8_weight(2 * 16, 40, block, seed=2)
    with pytest.raises(ValueError, match=r"a shared expert weight of shape \(32, 40\) for experts of shape "
                                         r"\(4, 40, 40\): it must be one expert's \(40, 40\)"):
        fp8_moe_experts(hidden, weights, ids, gate_up, gate_up_scale, down, down_scale, block, "silu",
                        other, other_scale, *shared[2:])


def test_ops_pass_opcheck_of_their_fake_kernels():
    # (opcheck's schema test multiplies the inputs, which float8 tensors do not take on the CPU.)
    weight, scale_inv = fp8_weight(64, 96, (32, 32))
    torch.library.opcheck(torch.ops.zoo.fp8_block_linear.default,
                          (torch.randn(3, 96), weight, scale_inv, [32, 32], torch.randn(64)), test_utils="test_faketensor")
    gate_up, gate_up_scale = fp8_weight(64, 32, (32, 32), leading=(4,))
    down, down_scale = fp8_weight(32, 32, (32, 32), leading=(4,))
    weights, ids = routed(3, 2, [0, 1, 2, 3])
    torch.library.opcheck(torch.ops.zoo.fp8_moe_experts.default,
                          (torch.randn(3, 32), weights, ids, gate_up, gate_up_scale, down, down_scale, [32, 32], "silu"),
                          test_utils="test_faketensor")
    shared = (*fp8_weight(64, 32, (32, 32), seed=2), *fp8_weight(32, 32, (32, 32), seed=3))
    torch.library.opcheck(torch.ops.zoo.fp8_moe_experts.default,
                          (torch.randn(3, 32), weights, ids, gate_up, gate_up_scale, down, down_scale, [32, 32], "silu",
                           *shared), test_utils="test_faketensor")


def test_weights_of_another_dtype_or_block_and_rows_of_another_width_are_named():
    weight, scale_inv = fp8_weight(64, 96, (32, 32))
    with pytest.raises(TypeError, match=r"zoo::fp8_block_linear takes a torch.float8_e4m3fn weight and float32 "
                                        r"scales, got torch.float32"):
        fp8_block_linear(torch.randn(1, 96), weight.float(), scale_inv, (32, 32), None)
    with pytest.raises(ValueError, match=r"zoo::fp8_block_linear: scales of shape \(2, 3\) do not match a weight of "
                                         r"shape \(64, 96\) in blocks of \[32, 48\]"):
        fp8_block_linear(torch.randn(1, 96), weight, scale_inv, (32, 48), None)
    with pytest.raises(ValueError, match=r"zoo::fp8_block_linear: x of shape \(1, 95\) for a weight of shape "
                                         r"\(64, 96\): its last dimension must be the weight's 96 columns"):
        fp8_block_linear(torch.randn(1, 95), weight, scale_inv, (32, 32), None)


def assert_rounded_to_nearest(x: torch.Tensor, quantised: torch.Tensor, scales: torch.Tensor, group: int):
    """Each FP8 value is the e4m3 value nearest its quotient x / scale (in float64, with its column's
    group's scale): within half the spacing of e4m3's values at the quotient's magnitude (3 mantissa
    bits: 2^(e - 4) in [2^e, 2^(e + 1)) from 2^-6 on, 2^-10 among the subnormals below it), and a hair
    more where the float32 quotient that is rounded differs from the exact one (2^-24 of it). The
    quotients stay within ±FP8_MAX, up to the float32 rounding of the scale."""
    values = quantised.double()
    assert values.isfinite().all()
    quotients = x.double() / scales.double()[:, torch.arange(x.shape[1]) // group]
    assert (quotients.abs() <= FP8_MAX * (1 + 2**-20)).all()
    half_spacing = torch.exp2(torch.floor(torch.log2(quotients.abs().clamp(min=2.0**-6))) - 4)
    assert ((values - quotients).abs() <= half_spacing + quotients.abs() * 2**-22).all()


def test_quantise_groups_scales_each_group_by_its_largest_magnitude():
    """The defining properties, each from the input alone: every group's scale is its largest
    magnitude over FP8_MAX (a floor for an all-zero group), laid out column-major, and that largest
    magnitude maps to ±FP8_MAX; each value is its quotient rounded to the nearest e4m3 value, so that
    x ~ fp8 * scale group by group."""
    torch.manual_seed(0)
    x = torch.randn(3, 100) * torch.tensor([1.0, 100.0, 0.01])[:, None]
    x[2, 64:96] = 0.0  # an all-zero group
    x[1, 5] = 0.0055  # a quotient of about 0.01: among e4m3's subnormals
    quantised, scales = quantise_groups_reference(x, 32)  # 4 groups, the last of 4 columns
    assert quantised.dtype == FP8_DTYPE and quantised.shape == (3, 100)
    assert scales.dtype == torch.float32 and scales.shape == (3, 4)
    assert scales.stride() == (1, 3)  # column-major, as the kernels read them
    for row in range(3):
        for group, first in enumerate(range(0, 100, 32)):
            largest = x[row, first : first + 32].abs().max().item()
            expected = torch.tensor(max(largest, MIN_GROUP_MAX), dtype=torch.float32) / FP8_MAX
            assert scales[row, group] == expected, (row, group)
            if largest:
                assert quantised[row, first : first + 32].float().abs().max() == FP8_MAX, (row, group)
    assert not quantised[2, 64:96].float().any()
    assert_rounded_to_nearest(x, quantised, scales, 32)
    # More values, for the rounding: one in a few hundred lies near enough a tie to show a rounding
    # that goes the wrong way there.
    x = torch.randn(64, 1000) * torch.logspace(-3, 3, 64)[:, None]
    assert_rounded_to_nearest(x, *quantise_groups_reference(x, 128), 128)


# ---------------------------------------------------------------------------------------------
# TRITON_INTERPRET=1: the kernels on tiny shapes
# ---------------------------------------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape, block, rows_per_program", [
    ((72, 112), (32, 16), 4),  # 7 scale groups in one step of 128 columns; partial row blocks
    ((45, 1100), (16, 128), 2),  # two steps of 1,024 columns, the last group partial; a partial last program
    ((45, 1100), (16, 128), 8),
    ((45, 1100), (12, 128), None),  # rows per program: a divisor of the 12-row scale blocks
])
def test_fp8_block_gemv_interpreted(dtype, shape, block, rows_per_program):
    from ops_cuda.fp8_triton import fp8_block_gemv_triton

    weight, scale_inv = fp8_weight(*shape, block)
    x, bias = torch.randn(1, shape[1]).to(dtype), torch.randn(shape[0]).to(dtype)
    ours = fp8_block_gemv_triton(x, weight, scale_inv, block, bias, rows=rows_per_program)
    assert ours.dtype == dtype and ours.shape == (shape[0],)
    expected = fp8_block_linear_reference(x, weight, scale_inv, block, bias)[0]
    assert relative_error(ours, expected) <= KERNEL_TOL[dtype]
    without_bias = fp8_block_gemv_triton(x, weight, scale_inv, block, None, rows=rows_per_program)
    expected = fp8_block_linear_reference(x, weight, scale_inv, block, None)[0]
    assert relative_error(without_bias, expected) <= KERNEL_TOL[dtype]


def test_one_row_takes_the_gemv_and_more_rows_a_gemm():
    from ops_cuda.fp8_triton import cuda_kernel

    weight, _ = fp8_weight(64, 256, (128, 128))
    assert cuda_kernel(torch.randn(1, 1, 256).bfloat16(), weight, (128, 128)) == "gemv"
    assert cuda_kernel(torch.randn(2, 256).bfloat16(), weight, (128, 128)) == "triton"
    assert cuda_kernel(torch.randn(1, 256), weight, (128, 128)) == "triton"  # float32 rows: the GEMM
    assert cuda_kernel(torch.randn(1, 256).bfloat16(), weight, (128, 96)) == "triton"  # groups of 96 columns
    assert cuda_kernel(torch.randn(1, 256).bfloat16(), weight, (3, 128)) == "triton"  # no rows per program divide 3


def test_gemv_rows_per_program_must_divide_the_row_blocks():
    from ops_cuda.fp8_triton import fp8_block_gemv_triton

    weight, scale_inv = fp8_weight(24, 64, (12, 32))
    with pytest.raises(ValueError, match="straddle row blocks of 12"):
        fp8_block_gemv_triton(torch.randn(1, 64), weight, scale_inv, (12, 32), None, rows=8)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 19])
def test_triton_block_gemm_interpreted(dtype, rows):
    from ops_cuda.fp8_triton import fp8_block_gemm_triton

    block = (32, 48)  # scales per 32 rows and 48 columns; 72 x 112: partial blocks at both edges
    weight, scale_inv = fp8_weight(72, 112, block)
    x, bias = torch.randn(rows, 112).to(dtype), torch.randn(72).to(dtype)
    ours = fp8_block_gemm_triton(x, weight, scale_inv, block, bias)
    assert ours.dtype == dtype and ours.shape == (rows, 72)
    expected = (quantised_product(x.float(), weight, scale_inv, block) + bias.float()).to(dtype)
    assert relative_error(ours, expected) <= KERNEL_TOL[dtype]
    assert relative_error(ours, fp8_block_linear_reference(x, weight, scale_inv, block, bias)) <= QUANTISATION_TOL["linear"]


@pytest.mark.interpreter
@pytest.mark.parametrize("tokens, top_k, allowed", [(1, 2, [0, 1, 2, 3]), (9, 2, [0, 2, 3])])
def test_fp8_fused_moe_interpreted(tokens, top_k, allowed):
    from ops_cuda.moe_triton import Fp8Scales, moe_experts_triton

    block = (16, 32)  # H = 48, I = 40: partial column blocks in both products, and a partial row block in down
    gate_up, gate_up_scale = fp8_weight(2 * 40, 48, block, leading=(4,))
    down, down_scale = fp8_weight(48, 40, block, leading=(4,), seed=1)
    hidden = torch.randn(tokens, 48)
    weights, ids = routed(tokens, top_k, allowed)
    scales = Fp8Scales(gate_up_scale, down_scale, block)
    ours = moe_experts_triton(hidden, weights, ids, gate_up, down, "silu", fp8=scales)
    expected = quantised_moe(hidden, weights, ids, gate_up, gate_up_scale, down, down_scale, block, "silu")
    assert relative_error(ours, expected) <= KERNEL_TOL[torch.float32]
    reference = fp8_moe_experts_reference(hidden, weights, ids, gate_up, gate_up_scale, down, down_scale, list(block), "silu")
    assert relative_error(ours, reference) <= QUANTISATION_TOL["moe"]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 9, 20])  # 20: the shared expert's run over two blocks of 16 rows
def test_fp8_fused_moe_with_the_shared_expert_interpreted(tokens, dtype):
    from ops_cuda.moe_triton import Fp8Scales, SharedExpert, moe_experts_triton, shared_supported

    block = (16, 32)
    gate_up, gate_up_scale = fp8_weight(2 * 40, 48, block, leading=(4,))
    down, down_scale = fp8_weight(48, 40, block, leading=(4,), seed=1)
    shared = (*fp8_weight(2 * 40, 48, block, seed=2), *fp8_weight(48, 40, block, seed=3))
    scales = Fp8Scales(gate_up_scale, down_scale, block)
    hidden = torch.randn(tokens, 48).to(dtype)
    weights, ids = routed(tokens, 2, [0, 2, 3])
    shared_expert = SharedExpert(shared[0], shared[2], shared[1], shared[3])
    assert shared_supported(shared_expert, gate_up, down, scales)
    assert not shared_supported(shared_expert._replace(gate_up=shared[0].t().contiguous().t()), gate_up, down, scales)
    ours = moe_experts_triton(hidden, weights, ids, gate_up, down, "silu", fp8=scales, shared=shared_expert)
    expected = quantised_moe(hidden, weights, ids, gate_up, gate_up_scale, down, down_scale, block, "silu", *shared)
    assert relative_error(ours, expected) <= KERNEL_TOL[dtype]
    reference = fp8_moe_experts_reference(hidden, weights, ids, gate_up, gate_up_scale, down, down_scale, list(block),
                                          "silu", *shared)
    assert relative_error(ours, reference) <= QUANTISATION_TOL["moe"]


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

DEEPSEEK_BLOCK = (128, 128)
# (K, N) of DeepSeek-V3's linear layers: q_a_proj, kv_a_proj_with_mqa (576 columns: no whole blocks,
# so never torch._scaled_mm's), q_b_proj, o_proj, and an expert's down projection.
DEEPSEEK_LINEARS = [(7168, 1536), (7168, 576), (1536, 24576), (16384, 7168), (2048, 7168)]


@functools.cache
def deepseek_weight(out_features: int, in_features: int, experts: int | None = None, seed: int = 0):
    """A CUDA FP8 weight in DeepSeek-V3's 128 x 128 blocks, made once per shape."""
    leading = () if experts is None else (experts,)
    return fp8_weight(out_features, in_features, DEEPSEEK_BLOCK, "cuda", leading=leading, seed=seed)


def force_gemm(monkeypatch, kernel: str):
    """Moves the dispatch's threshold so that ``kernel`` runs whatever the number of rows."""
    import ops_cuda.fp8_triton

    if kernel == "scaled_mm" and not ops_cuda.fp8_triton.scaled_mm_available(torch.device("cuda", 0)):
        pytest.skip("this torch or device has no block-scaled torch._scaled_mm")
    monkeypatch.setattr(ops_cuda.fp8_triton, "SCALED_MM_MIN_ROWS", 0 if kernel == "scaled_mm" else 1 << 62)


@pytest.mark.gpu
def test_quantise_groups_kernel_matches_the_reference():
    from ops_cuda.fp8_triton import quantise_groups_triton

    x = (torch.randn(37, 7168 + 40, device="cuda") * 3).bfloat16()  # a partial last group
    quantised, scales = quantise_groups_triton(x, 128)
    expected_quantised, expected_scales = quantise_groups_reference(x, 128)
    assert scales.stride() == expected_scales.stride()
    torch.testing.assert_close(scales, expected_scales, rtol=1e-6, atol=0)
    # Divisions rounded differently may move a value to the neighbouring float8: one step, at most 2^-3
    # of it (2^-9 among the subnormals).
    difference = (quantised.float() - expected_quantised.float()).abs()
    assert (difference <= expected_quantised.float().abs() * 2**-3 + 2**-9).all()
    assert (difference > 0).float().mean() < 1e-3


@pytest.mark.gpu
def test_scaled_mm_runs_block_scaled_on_sm90():
    from ops_cuda.fp8_triton import scaled_mm_available

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("cuBLASLt's block-scaled FP8 GEMM is sm90's")
    assert scaled_mm_available(torch.device("cuda", 0)), "torch._scaled_mm refused 1x128 / 128x128 block scales"


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_program", [None, 2, 4, 8])
@pytest.mark.parametrize("k, n", DEEPSEEK_LINEARS)
def test_fp8_block_gemv_on_deepseek_shapes(rows_per_program, k, n):
    from ops_cuda.fp8_triton import cuda_kernel, fp8_block_gemv_triton

    weight, scale_inv = deepseek_weight(n, k)
    x = torch.randn(1, k, device="cuda").bfloat16()
    assert cuda_kernel(x, weight, DEEPSEEK_BLOCK) == "gemv"
    ours = (fp8_block_linear(x, weight, scale_inv, DEEPSEEK_BLOCK, None) if rows_per_program is None
            else fp8_block_gemv_triton(x, weight, scale_inv, DEEPSEEK_BLOCK, None, rows=rows_per_program))
    assert ours.dtype == torch.bfloat16 and ours.numel() == n
    reference = fp8_block_linear_reference(x, weight, scale_inv, DEEPSEEK_BLOCK, None)
    assert relative_error(ours.view(1, n), reference) <= KERNEL_TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton", "scaled_mm"])
@pytest.mark.parametrize("rows", [2, 5, 64, 300])
@pytest.mark.parametrize("k, n", DEEPSEEK_LINEARS)
def test_fp8_block_linear_on_deepseek_shapes(monkeypatch, kernel, rows, k, n):
    from ops_cuda.fp8_triton import cuda_kernel

    force_gemm(monkeypatch, kernel)
    weight, scale_inv = deepseek_weight(n, k)
    x = torch.randn(rows, k, device="cuda").bfloat16()
    expected_kernel = kernel if kernel == "triton" or n % 128 == 0 else "triton"
    assert cuda_kernel(x, weight, DEEPSEEK_BLOCK) == expected_kernel
    ours = fp8_block_linear(x, weight, scale_inv, DEEPSEEK_BLOCK, None)
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, n)
    assert relative_error(ours, quantised_product(x, weight, scale_inv, DEEPSEEK_BLOCK)) <= KERNEL_TOL[torch.bfloat16]
    reference = fp8_block_linear_reference(x, weight, scale_inv, DEEPSEEK_BLOCK, None)
    assert relative_error(ours, reference) <= QUANTISATION_TOL["linear"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp8_block_linear_other_dtypes_bias_and_leading_dims(dtype):
    weight, scale_inv = deepseek_weight(384, 1024)
    x, bias = torch.randn(2, 7, 1024, device="cuda").to(dtype), torch.randn(384, device="cuda").to(dtype)
    ours = fp8_block_linear(x, weight, scale_inv, DEEPSEEK_BLOCK, bias)
    assert ours.dtype == dtype and ours.shape == (2, 7, 384)
    expected = quantised_product(x.reshape(14, 1024).float(), weight, scale_inv, DEEPSEEK_BLOCK) + bias.float()
    assert relative_error(ours.reshape(14, 384), expected) <= KERNEL_TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "with_shared"])
@pytest.mark.parametrize("tokens", [1, 8, 64, 512])  # with the shared expert: in the launch up to 32 tokens
def test_fp8_moe_experts_on_deepseek_expert_shapes(tokens, shared):
    from ops_cuda.moe_triton import Fp8Scales, triton_supported

    num_experts, hidden_size, intermediate = 16, 7168, 2048  # DeepSeek-V3's experts (top-8), fewer of them
    gate_up, gate_up_scale = deepseek_weight(2 * intermediate, hidden_size, num_experts)
    down, down_scale = deepseek_weight(hidden_size, intermediate, num_experts, seed=1)
    shared = (*deepseek_weight(2 * intermediate, hidden_size, seed=2), *deepseek_weight(hidden_size, intermediate, seed=3)
              ) if shared else ()
    hidden = torch.randn(tokens, hidden_size, device="cuda").bfloat16()
    weights, ids = routed(tokens, 8, list(range(num_experts)), device="cuda")
    assert triton_supported(hidden, gate_up, down, "silu", Fp8Scales(gate_up_scale, down_scale, DEEPSEEK_BLOCK))
    ours = fp8_moe_experts(hidden, weights, ids, gate_up, gate_up_scale, down, down_scale, DEEPSEEK_BLOCK, "silu",
                           *shared)
    assert ours.dtype == torch.bfloat16 and ours.shape == hidden.shape
    reference = fp8_moe_experts_reference(hidden, weights, ids, gate_up, gate_up_scale, down, down_scale,
                                          list(DEEPSEEK_BLOCK), "silu", *shared)
    assert relative_error(ours, reference) <= QUANTISATION_TOL["moe"]
    # The pair-by-pair oracle is slow: on the first four and last four tokens past 8 (tokens are independent).
    # h's bf16 rounding may move a quantised value one step.
    rows = torch.arange(tokens) if tokens <= 8 else torch.cat([torch.arange(4), torch.arange(tokens - 4, tokens)])
    expected = quantised_moe(hidden[rows], weights[rows], ids[rows], gate_up, gate_up_scale, down, down_scale,
                             DEEPSEEK_BLOCK, "silu", *shared)
    assert relative_error(ours[rows], expected) <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4])  # one row: the linear's single-row kernel; four: the GEMM
def test_fp8_ops_replay_in_a_cuda_graph(tokens):
    """Captured once, replayed over the captured inputs, then over new activations and a new routing
    written into the same buffers (copy_): each replay is the eager ops' output on the values it read
    and within the activations' quantisation of the references; a graph that kept its captured values
    (read on the host, copied or cached at capture) fails the second."""
    weight, scale_inv = deepseek_weight(1536, 7168)
    gate_up, gate_up_scale = deepseek_weight(512, 1024, 8)
    down, down_scale = deepseek_weight(1024, 256, 8, seed=1)
    x = torch.randn(tokens, 7168, device="cuda").bfloat16()
    hidden = torch.randn(tokens, 1024, device="cuda").bfloat16()
    weights, ids = routed(tokens, 2, list(range(8)), device="cuda")
    shared = (*deepseek_weight(512, 1024, seed=2), *deepseek_weight(1024, 256, seed=3))
    experts = (gate_up, gate_up_scale, down, down_scale)

    def step():
        return (fp8_block_linear(x, weight, scale_inv, DEEPSEEK_BLOCK, None),
                fp8_moe_experts(hidden, weights, ids, *experts, DEEPSEEK_BLOCK, "silu"),
                fp8_moe_experts(hidden, weights, ids, *experts, DEEPSEEK_BLOCK, "silu", *shared))

    def references():
        block = list(DEEPSEEK_BLOCK)
        return (fp8_block_linear_reference(x, weight, scale_inv, block, None),
                fp8_moe_experts_reference(hidden, weights, ids, *experts, block, "silu"),
                fp8_moe_experts_reference(hidden, weights, ids, *experts, block, "silu", *shared))

    step()  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    replays = []
    for replay in range(2):
        if replay:  # new values in the captured buffers
            x.copy_(torch.randn_like(x))
            hidden.copy_(torch.randn_like(hidden))
            new_weights, new_ids = routed(tokens, 2, list(range(8)), seed=1, device="cuda")
            weights.copy_(new_weights)
            ids.copy_(new_ids)
        eager = step()
        for out in captured:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for replayed, eager_out, reference, op in zip(captured, eager, references(), ("linear", "moe", "moe"),
                                                      strict=True):
            assert torch.equal(replayed, eager_out), f"replay {replay}: {op}"
            assert relative_error(replayed, reference) <= QUANTISATION_TOL[op]
        replays.append([out.clone() for out in captured])
    assert all(not torch.equal(before, after) for before, after in zip(*replays))


def kernel_arithmetic_on_cpu(monkeypatch):
    """Makes the FP8 layers on the CPU compute what the CUDA kernels compute (``quantised_product``,
    ``quantised_moe``) instead of the ops' references."""
    import layers.linear
    import layers.moe

    def linear(x, weight, scale_inv, block, bias):
        out = quantised_product(x.reshape(-1, x.shape[-1]).float(), weight, scale_inv, block)
        out = out if bias is None else out + bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])

    monkeypatch.setattr(layers.linear, "fp8_block_linear", linear)
    monkeypatch.setattr(layers.moe, "fp8_moe_experts", quantised_moe)


@pytest.mark.gpu
def test_deepseek_v3_fp8_checkpoint_on_cuda_keeps_fp8(tmp_path, monkeypatch):
    from models import AutoModelForCausalLM
    from tests.loaders.test_fp8 import QUANTIZATION, TOKENS, write_pair
    from tests.models.test_deepseek_v3 import deepseek_config, deepseek_hf_model

    hf = deepseek_hf_model(deepseek_config(n_shared_experts=1))  # its shared expert in the experts' launch
    # Blocks of 16 x 32: whole blocks for every expert's 16 gate and up rows, and K-steps of 32 columns.
    fp8, twin = write_pair(hf, hf.state_dict(), tmp_path, quantization={**QUANTIZATION, "weight_block_size": [16, 32]})
    model = AutoModelForCausalLM.from_pretrained(fp8, device="cuda")  # float32; FP8 kept: the default on CUDA
    attention, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert attention.q_b_proj.weight.dtype == moe.experts.gate_up_proj.dtype == FP8_DTYPE
    assert moe.experts.takes_shared(moe.shared_experts)
    assert attention.q_b_proj.weight.is_cuda and attention.q_b_proj.weight_scale_inv.is_cuda
    assert attention.kv_b_proj.weight.dtype == torch.float32
    with torch.no_grad():
        ours = model(TOKENS.cuda()).cpu()
    # Against the twin, this tiny random model's logits move by ~25% of the largest one: every product
    # quantises its activations to e4m3 first (measured on the CPU with the kernels' arithmetic). So the
    # oracle is that arithmetic in float32 on the CPU. Where a float32 difference moves an activation
    # to the neighbouring float8 (rare), that activation changes by 2^-3: hence 1e-2, not 1e-5.
    with monkeypatch.context() as patched:
        kernel_arithmetic_on_cpu(patched)
        expected = AutoModelForCausalLM.from_pretrained(fp8, keep_fp8=True)
        with torch.no_grad():
            expected = expected(TOKENS)
    assert relative_error(ours, expected) <= 1e-2
    # Dequantised on load instead, on CUDA too: the twin's logits exactly.
    dequantised = AutoModelForCausalLM.from_pretrained(fp8, dtype="bfloat16", device="cuda", keep_fp8=False)
    assert dequantised.model.layers[1].self_attn.q_b_proj.weight.dtype == torch.bfloat16
    twin_model = AutoModelForCausalLM.from_pretrained(twin, dtype="bfloat16", device="cuda")
    with torch.no_grad():
        assert torch.equal(dequantised(TOKENS.cuda()), twin_model(TOKENS.cuda()))
