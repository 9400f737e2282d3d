"""zoo::fused_add_rms_norm_gemv, a decoder layer's pre-norm folded into the projection that reads
it: every program of the GEMV kernel sums the row with the residual and takes its RMS, program 0
writes the sum, and the normalised row multiplies the weight; bit-equal to zoo::fused_add_rms_norm
then zoo::gemv.
"""

import pytest
import torch

pytest.importorskip("triton")

from ops_cuda import fused_add_rms_norm, fused_add_rms_norm_gemv, gemv  # noqa: E402
from ops_cuda import triton_kernels as kernels  # noqa: E402
from ops_cuda.gemv import gemv_reference  # noqa: E402
from ops_cuda.norm import fused_add_rms_norm_reference  # noqa: E402
from tests.ops.test_triton_ops import EPS, GEMV_TOL, assert_close, exact_gemv, replay_in_graph  # noqa: E402

# No tl.dot in the GEMV kernel, so bfloat16 runs in the interpreter too; but its float32 -> bfloat16
# cast truncates, so bfloat16 is compared with the separate kernels (the same casts) and
# float32/float16 with the reference as well.
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (weight_offset, multiply_in_float32): Llama's, Gemma's, and the two options apart.
VARIANTS = {"llama": (0.0, False), "gemma": (1.0, True), "offset": (1.0, False), "float32": (0.0, True)}


def norm_gemv_inputs(n: int, k: int, lead: tuple, bias: bool, dtype, device="cpu"):
    x = torch.randn(*lead, k, device=device).to(dtype)
    residual = (torch.randn(*lead, k, device=device) * 3).to(dtype)
    norm_weight = (1 + 0.2 * torch.randn(k, device=device)).to(dtype)
    weight = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    return x, residual, norm_weight, weight, torch.randn(n, device=device).to(dtype) if bias else None


def exact_norm_gemv(x, residual, norm_weight, options, weight, bias):
    normed, summed = fused_add_rms_norm_reference(x, residual, norm_weight, EPS, *options)
    return exact_gemv(normed, weight, bias), summed


# ---------------------------------------------------------------------------------------------
# CPU: the launcher under Triton's interpreter, and the reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("n, k, lead", [(37, 100, (1,)), (16, 1030, (1, 1)), (8, 512, ())])
def test_norm_gemv_is_fused_add_rms_norm_then_gemv_interpreted(n, k, lead, bias, variant, dtype):
    torch.manual_seed(0)
    x, residual, norm_weight, weight, b = norm_gemv_inputs(n, k, lead, bias, dtype)
    options = VARIANTS[variant]
    summed = torch.full_like(x, float("nan"))
    fused = kernels.fused_add_rms_norm_gemv_triton(x, residual, norm_weight, EPS, *options, weight, b, summed)
    normed, expected_summed = kernels.fused_add_rms_norm_triton(x, residual, norm_weight, EPS, *options)
    assert fused.shape == (*lead, n) and fused.dtype == dtype
    assert torch.equal(fused, kernels.gemv_triton(normed, weight, b))
    assert torch.equal(summed, expected_summed)
    if dtype != torch.bfloat16:
        expected, exact_summed = exact_norm_gemv(x, residual, norm_weight, options, weight, b)
        assert_close(fused, expected, GEMV_TOL[dtype])
        assert torch.equal(summed, exact_summed)


@pytest.mark.interpreter
def test_norm_gemv_checks_its_inputs_interpreted():
    x, residual, norm_weight, weight, _ = norm_gemv_inputs(4, 8, (1,), False, torch.float32)
    summed = torch.empty_like(x)
    launch = kernels.fused_add_rms_norm_gemv_triton
    with pytest.raises(ValueError, match=r"zoo::fused_add_rms_norm_gemv needs x, residual and summed of one shape "
                                         r"and a norm weight of their last dim, got \(1, 8\), \(1, 8\), \(1, 8\), \(4,\)"):
        launch(x, residual, norm_weight[:4], EPS, 0.0, False, weight, None, summed)
    with pytest.raises(ValueError, match="zoo::fused_add_rms_norm_gemv needs a contiguous summed"):
        launch(x, residual, norm_weight, EPS, 0.0, False, weight, None, torch.empty(8, 2)[:, 0].view(1, 8))
    with pytest.raises(ValueError, match=r"zoo::fused_add_rms_norm_gemv multiplies one row: x has shape \(2, 8\)"):
        launch(x.repeat(2, 1), residual.repeat(2, 1), norm_weight, EPS, 0.0, False, weight, None, summed.repeat(2, 1))
    with pytest.raises(TypeError, match="zoo::fused_add_rms_norm_gemv"):
        launch(x, residual, norm_weight.half(), EPS, 0.0, False, weight, None, summed)


@pytest.mark.parametrize("variant", VARIANTS)
def test_norm_gemv_reference_is_the_composition(variant):
    torch.manual_seed(0)
    x, residual, norm_weight, weight, b = norm_gemv_inputs(24, 40, (1,), True, torch.bfloat16)
    options = VARIANTS[variant]
    summed = torch.empty_like(x)
    out = fused_add_rms_norm_gemv(x, residual, norm_weight, EPS, *options, weight, b, summed)
    normed, expected_summed = fused_add_rms_norm(x, residual, norm_weight, EPS, *options)
    assert torch.equal(out, gemv_reference(normed, weight, b))
    assert torch.equal(summed, expected_summed)


# ---------------------------------------------------------------------------------------------
# GPU: the registered op on CUDA tensors, eager and under CUDA-graph capture
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("n, k", [(6144, 4096), (28672, 4096), (1000, 1003), (4864, 896)])
def test_norm_gemv_gpu(n, k, bias, variant, dtype):
    torch.manual_seed(0)
    x, residual, norm_weight, weight, b = norm_gemv_inputs(n, k, (1,), bias, dtype, "cuda")
    options = VARIANTS[variant]
    summed = torch.full_like(x, float("nan"))
    fused = fused_add_rms_norm_gemv(x, residual, norm_weight, EPS, *options, weight, b, summed)
    normed, expected_summed = fused_add_rms_norm(x, residual, norm_weight, EPS, *options)
    assert torch.equal(summed, expected_summed)
    assert torch.equal(fused, gemv(normed, weight, b))
    expected, _ = exact_norm_gemv(x, residual, norm_weight, options, weight, b)
    assert_close(fused, expected, GEMV_TOL[dtype])


@pytest.mark.gpu
def test_norm_gemv_in_cuda_graph():
    torch.manual_seed(0)
    x, residual, norm_weight, weight, b = norm_gemv_inputs(6144, 4096, (1,), True, torch.bfloat16, "cuda")
    summed = torch.empty_like(x)
    args = (x, residual, norm_weight, EPS, 0.0, False, weight, b, summed)
    (replayed,) = replay_in_graph(fused_add_rms_norm_gemv, *args)
    assert torch.equal(summed, residual + x)
    assert torch.equal(replayed, fused_add_rms_norm_gemv(*args))
    torch.library.opcheck(torch.ops.zoo.fused_add_rms_norm_gemv, args, test_utils=("test_schema", "test_faketensor"))
