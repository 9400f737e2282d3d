"""GatedMLP's gate_up product: zoo::gated_gemv where zoo::gemv would multiply its single row; the
ungated MLP's activations, HF's bit for bit, and its products on the GPU's single-row path.

On the CPU the dispatch is made to take the GPU's branch (``takes_gemv``) and the ops' Triton
kernels run in Triton's interpreter; on a GPU (``gpu`` tests) it runs as it is.
"""

import pytest
import torch

pytest.importorskip("triton")

import layers.linear  # noqa: E402
import layers.mlp  # noqa: E402
import ops_cuda.linear  # noqa: E402
from layers import GatedMLP, UngatedMLP  # noqa: E402
from layers.mlp import PLAIN_ACTIVATIONS  # noqa: E402
from ops_cuda import act_and_mul, gated_gemv  # noqa: E402
from ops_cuda import triton_kernels as kernels  # noqa: E402

# Two products, each accumulated in float32 and rounded once (tests/ops/test_triton_ops.py's GEMV_TOL, twice).
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}


def gated_mlp(dtype, bias: bool, hidden_act: str = "silu", device: str = "cpu") -> GatedMLP:
    torch.manual_seed(0)
    mlp = GatedMLP(72, 37, hidden_act, bias=bias)
    with torch.no_grad():
        for parameter in mlp.parameters():
            parameter.copy_(torch.randn(parameter.shape) / 8)
    return mlp.to(device, dtype)


def unfused(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(act_and_mul(mlp.gate_up_proj(x), mlp.hidden_act))


def assert_close(out: torch.Tensor, expected: torch.Tensor):
    assert out.shape == expected.shape and out.dtype == expected.dtype
    tol = TOL[expected.dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol * expected.abs().max().item())


def record_gated_gemv(monkeypatch, kernel=gated_gemv) -> list:
    """Makes GatedMLP call ``kernel`` for zoo::gated_gemv; returns the list each call's arguments are appended to."""
    sent = []
    monkeypatch.setattr(layers.mlp, "gated_gemv", lambda *args: sent.append(args) or kernel(*args))
    return sent


def products_as_on_a_gpu(monkeypatch) -> list:
    """Every product takes the GPU's single-row branch, run by the kernels in the interpreter; returns
    the list each zoo::gated_gemv call's arguments are appended to."""
    for module in (layers.mlp, ops_cuda.linear):
        monkeypatch.setattr(module, "takes_gemv", lambda x, weight: True)
    monkeypatch.setattr(ops_cuda.linear, "gemv", kernels.gemv_triton)
    return record_gated_gemv(monkeypatch, kernels.gated_gemv_triton)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
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
    _, weight, bias_sent, activation = sent[0]
    assert weight is mlp.gate_up_proj.weight and bias_sent is mlp.gate_up_proj.bias and activation == hidden_act
    assert_close(out, expected)


def test_gated_mlp_on_the_cpu_is_act_and_mul_of_gate_up(monkeypatch):
    mlp = gated_mlp(torch.float32, True)
    x = torch.randn(3, 72)
    sent = record_gated_gemv(monkeypatch)
    with torch.no_grad():
        assert torch.equal(mlp(x), unfused(mlp, x))
        assert torch.equal(mlp(x[:1]), unfused(mlp, x[:1]))
    assert not sent


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
    assert not sent  # the unfused reference's product, then the layer's
    assert len(fp8_products) == 2 and all(weight is mlp.gate_up_proj.weight for weight in fp8_products)
    assert_close(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_gated_mlp_sends_single_gpu_rows_to_gated_gemv(monkeypatch, bias):
    mlp = gated_mlp(torch.bfloat16, bias, device="cuda")
    x = torch.randn(4, 72, device="cuda").to(torch.bfloat16)
    sent = record_gated_gemv(monkeypatch)
    with torch.no_grad():
        assert torch.equal(mlp(x), unfused(mlp, x))  # several rows: F.linear, then act_and_mul
        assert not sent
        assert_close(mlp(x[:1]), unfused(mlp, x[:1]))
        assert len(sent) == 1
        # A CPU-loaded Linear's layout, moved to the GPU: F.linear, then act_and_mul.
        mlp.gate_up_proj.weight.data = mlp.gate_up_proj.weight.t().contiguous().t()
        assert torch.equal(mlp(x[:1]), unfused(mlp, x[:1]))
        assert len(sent) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(PLAIN_ACTIVATIONS))
def test_ungated_activations_are_hf_bit_for_bit(name, dtype):
    from transformers.activations import ACT2FN

    torch.manual_seed(0)
    x = (torch.randn(4096) * 4).to(dtype)
    assert torch.equal(PLAIN_ACTIVATIONS[name](x), ACT2FN[name](x))


@pytest.mark.interpreter
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_ungated_mlp_on_the_gpus_single_row_path(monkeypatch, bias):
    """Arcee's relu² MLP, each product of a single float16 row through zoo::gemv's kernel."""
    torch.manual_seed(0)
    mlp = UngatedMLP(72, 37, "relu2", bias=bias)
    with torch.no_grad():
        for parameter in mlp.parameters():
            parameter.copy_(torch.randn(parameter.shape) / 8)
    mlp = mlp.to(torch.float16)
    x = torch.randn(1, 72).to(torch.float16)
    linear = torch.nn.functional.linear
    with torch.no_grad():
        expected = linear(torch.square(torch.relu(linear(x, mlp.up_proj.weight, mlp.up_proj.bias))),
                          mlp.down_proj.weight, mlp.down_proj.bias)
        products_as_on_a_gpu(monkeypatch)
        sent = []
        gemv = ops_cuda.linear.gemv
        monkeypatch.setattr(ops_cuda.linear, "gemv", lambda *args: sent.append(args[1]) or gemv(*args))
        out = mlp(x)
    assert len(sent) == 2 and sent[0] is mlp.up_proj.weight and sent[1] is mlp.down_proj.weight
    assert_close(out, expected)
