"""zoo::gated_gemv, a gated MLP's down projection on one row: act(gate) * up computed as the GEMV
kernel reads its input, bit-equal to zoo::act_and_mul then zoo::gemv; and the routing of
``ops_cuda.linear.linear`` and ``layers.Linear`` to it.
"""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import ops_cuda.linear  # noqa: E402
from layers import GatedMLP, Linear  # noqa: E402
from ops_cuda import ACTIVATIONS, act_and_mul, gated_gemv, gemv  # noqa: E402
from ops_cuda import triton_kernels as kernels  # noqa: E402
from ops_cuda.activation import act_and_mul_reference  # noqa: E402
from ops_cuda.gemv import gated_gemv_reference  # noqa: E402
from tests.ops.test_triton_ops import GEMV_TOL, assert_close, exact_gemv, replay_in_graph, run_poisoned  # noqa: E402

# No tl.dot in the GEMV kernel, so bfloat16 runs in the interpreter too; but its float32 -> bfloat16
# cast truncates (-48.14 -> -48.0, not -48.25), so bfloat16 is compared with the separate kernels
# (the same casts) and float32/float16 with the reference as well.
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def gated_inputs(n: int, k: int, lead: tuple, bias: bool, dtype, device="cpu"):
    # gate and up wide enough to reach the saturated ends of each activation.
    x = (torch.randn(*lead, 2 * k, device=device) * 4).to(dtype)
    weight = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    return x, weight, torch.randn(n, device=device).to(dtype) if bias else None


def exact_gated_gemv(x, weight, bias, activation):
    return exact_gemv(act_and_mul_reference(x, activation), weight, bias)


# ---------------------------------------------------------------------------------------------
# CPU: the launcher under Triton's interpreter, and the routing
# ---------------------------------------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("n, k, lead", [(37, 100, (1,)), (16, 1030, (1, 1)), (8, 512, ())])
def test_gated_gemv_is_act_and_mul_then_gemv_interpreted(n, k, lead, bias, activation, dtype):
    torch.manual_seed(0)
    x, weight, b = gated_inputs(n, k, lead, bias, dtype)
    fused = kernels.gated_gemv_triton(x, weight, b, activation)
    separate = kernels.gemv_triton(kernels.act_and_mul_triton(x, activation), weight, b)
    assert fused.shape == (*lead, n) and fused.dtype == dtype
    assert torch.equal(fused, separate)
    if dtype != torch.bfloat16:
        assert_close(fused, exact_gated_gemv(x, weight, b, activation), GEMV_TOL[dtype])


@pytest.mark.interpreter
def test_gated_gemv_checks_its_input_interpreted():
    with pytest.raises(ValueError, match=r"zoo::gated_gemv multiplies one row of \[gate, up\] \(16 values\): "
                                         r"x has shape \(1, 8\) for a weight of 8 columns"):
        kernels.gated_gemv_triton(torch.randn(1, 8), torch.randn(4, 8), None, "silu")
    with pytest.raises(ValueError, match="unsupported activation 'tanh'"):
        kernels.gated_gemv_triton(torch.randn(1, 16), torch.randn(4, 8), None, "tanh")
    with pytest.raises(TypeError, match="zoo::gated_gemv"):
        kernels.gated_gemv_triton(torch.randn(1, 16), torch.randn(4, 8, dtype=torch.float16), None, "silu")


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_gated_gemv_reference_is_the_composition(activation):
    torch.manual_seed(0)
    x, weight, b = gated_inputs(24, 40, (1,), True, torch.bfloat16)
    expected = F.linear(act_and_mul(x, activation), weight, b)
    assert torch.equal(gated_gemv(x, weight, b, activation), expected)
    assert torch.equal(gated_gemv_reference(x, weight, b, activation), expected)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_with_activation_multiplies_act_and_mul_on_cpu(rows, dtype):
    torch.manual_seed(0)
    x, weight, b = gated_inputs(24, 40, (rows,), True, dtype)
    expected = F.linear(act_and_mul(x, "silu"), weight, b)
    assert torch.equal(ops_cuda.linear.linear(x, weight, b, activation="silu"), expected)
    layer = Linear(40, 24, bias=True).to(dtype)
    layer.weight.copy_(weight)
    layer.bias.copy_(b)
    assert torch.equal(layer(x, activation="silu"), expected)


def test_gated_mlp_multiplies_act_and_mul_of_gate_up():
    torch.manual_seed(0)
    mlp = GatedMLP(32, 48, "gelu_pytorch_tanh").to(torch.bfloat16)
    for parameter in mlp.parameters():
        parameter.copy_(torch.randn_like(parameter) * 0.2)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    gate_up = F.linear(x, mlp.gate_up_proj.weight)
    assert torch.equal(mlp(x), F.linear(act_and_mul(gate_up, "gelu_pytorch_tanh"), mlp.down_proj.weight))


# ---------------------------------------------------------------------------------------------
# GPU: the registered op on CUDA tensors, eager and under CUDA-graph capture
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("n, k", [(4096, 14336), (1000, 1003), (896, 4864)])
def test_gated_gemv_gpu(n, k, bias, activation, dtype):
    torch.manual_seed(0)
    x, weight, b = gated_inputs(n, k, (1,), bias, dtype, "cuda")
    fused = run_poisoned(gated_gemv, x, weight, b, activation)
    assert torch.equal(fused, gemv(act_and_mul(x, activation), weight, b))
    assert_close(fused, exact_gated_gemv(x, weight, b, activation), GEMV_TOL[dtype])


@pytest.mark.gpu
def test_gated_gemv_in_cuda_graph():
    torch.manual_seed(0)
    args = (*gated_inputs(4096, 14336, (1,), False, torch.bfloat16, "cuda"), "silu")
    (replayed,) = replay_in_graph(gated_gemv, *args)
    assert torch.equal(replayed, gated_gemv(*args))
    torch.library.opcheck(torch.ops.zoo.gated_gemv, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_linear_sends_single_gated_rows_to_gated_gemv(monkeypatch):
    torch.manual_seed(0)
    x, weight, bias = gated_inputs(300, 256, (4,), True, torch.bfloat16, "cuda")
    sent = []
    monkeypatch.setattr(ops_cuda.linear, "gated_gemv", lambda *args: sent.append(args) or gated_gemv(*args))
    linear = ops_cuda.linear.linear
    assert torch.equal(linear(x, weight, bias, activation="silu"), F.linear(act_and_mul(x, "silu"), weight, bias))
    assert not sent
    assert torch.equal(linear(x[:1], weight, bias, activation="silu"), gemv(act_and_mul(x[:1], "silu"), weight, bias))
    assert len(sent) == 1
    column_major = weight.t().contiguous().t()  # a CPU-loaded Linear's layout, moved to the GPU
    expected = F.linear(act_and_mul(x[:1], "silu"), column_major, bias)
    assert torch.equal(linear(x[:1], column_major, bias, activation="silu"), expected)
    assert len(sent) == 1
