"""GatedMLP's gate_up product: zoo::gated_gemv where zoo::gemv would multiply its single row.

On the CPU the dispatch is made to take the GPU's branch (``takes_gemv``) and the ops' Triton
kernels run in Triton's interpreter.
"""

import pytest
import torch

pytest.importorskip("triton")

import layers.linear  # noqa: E402
import ops_cuda.linear  # noqa: E402
from layers import GatedMLP  # noqa: E402
from ops_cuda import act_and_mul  # noqa: E402
from ops_cuda import triton_kernels as kernels  # noqa: E402

# Two products, each accumulated in float32 and rounded once (tests/ops/test_triton_ops.py's GEMV_TOL, twice).
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def gated_mlp(dtype, bias: bool, hidden_act: str = "silu") -> GatedMLP:
    torch.manual_seed(0)
    mlp = GatedMLP(72, 37, hidden_act, bias=bias)
    with torch.no_grad():
        for parameter in mlp.parameters():
            parameter.copy_(torch.randn(parameter.shape) / 8)
    return mlp.to(dtype)


def unfused(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(act_and_mul(mlp.gate_up_proj(x), mlp.hidden_act))


def products_as_on_a_gpu(monkeypatch) -> list:
    """Every product takes the GPU's single-row branch, run by the kernels in the interpreter; returns
    the list that each zoo::gated_gemv call's arguments are appended to."""
    sent = []
    monkeypatch.setattr(ops_cuda.linear, "takes_gemv", lambda x, weight: True)
    monkeypatch.setattr(ops_cuda.linear, "gemv", kernels.gemv_triton)
    monkeypatch.setattr(ops_cuda.linear, "gated_gemv",
                        lambda *args: sent.append(args) or kernels.gated_gemv_triton(*args))
    return sent


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", TOL, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("hidden_act", ["silu", "gelu_pytorch_tanh"])
def test_gated_mlp_takes_gated_gemv_where_gemv_runs(monkeypatch, hidden_act, bias, dtype):
    mlp = gated_mlp(dtype, bias, hidden_act)
    x = torch.randn(1, 72).to(dtype)
    with torch.no_grad():
        expected = unfused(mlp, x)
        sent = products_as_on_a_gpu(monkeypatch)
        out = mlp(x)
    assert len(sent) == 1
    x_sent, weight, bias_sent, activation = sent[0]
    assert weight is mlp.gate_up_proj.weight and bias_sent is mlp.gate_up_proj.bias and activation == hidden_act
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, rtol=TOL[dtype], atol=TOL[dtype] * expected.abs().max().item())


def test_gated_mlp_on_the_cpu_is_act_and_mul_of_gate_up():
    mlp = gated_mlp(torch.float32, True)
    x = torch.randn(3, 72)
    with torch.no_grad():
        assert torch.equal(mlp(x), unfused(mlp, x))
        assert torch.equal(mlp(x[:1]), unfused(mlp, x[:1]))


@pytest.mark.interpreter
def test_gated_mlp_with_fp8_weights_keeps_its_fp8_product(monkeypatch):
    # An FP8 block-scaled gate_up weight multiplies through zoo::fp8_block_linear, then act_and_mul.
    mlp = gated_mlp(torch.float16, False)
    mlp.gate_up_proj.fp8_block = (16, 16)
    fp8_products = []

    def fp8_block_linear(x, weight, scale_inv, block, bias):
        fp8_products.append(weight)
        return torch.nn.functional.linear(x, weight, bias)

    monkeypatch.setattr(layers.linear, "fp8_block_linear", fp8_block_linear)
    x = torch.randn(1, 72).to(torch.float16)
    with torch.no_grad():
        expected = unfused(mlp, x)
        sent = products_as_on_a_gpu(monkeypatch)
        out = mlp(x)
    assert not sent  # the reference's product, then this one
    assert len(fp8_products) == 2 and all(weight is mlp.gate_up_proj.weight for weight in fp8_products)
    torch.testing.assert_close(out, expected, rtol=TOL[torch.float16], atol=TOL[torch.float16] * expected.abs().max().item())
