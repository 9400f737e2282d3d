"""zoo's Triton kernels against the ops' PyTorch references.

Without a GPU, the launchers run on CPU tensors in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before the kernels are defined). On a GPU, the ``gpu`` tests run the registered
ops on CUDA tensors: eagerly, with their outputs' memory poisoned with NaN, and inside a captured
CUDA graph.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from ops_cuda import (  # noqa: E402
    GATED_ACTIVATIONS, act_and_mul, apply_rotary, argmax, fused_add_rms_norm, gated_gemv, gemv, rms_norm,
    write_kv_cache,
)
import ops_cuda.linear  # noqa: E402
from ops_cuda import triton_kernels as kernels  # noqa: E402
from ops_cuda.activation import act_and_mul_reference  # noqa: E402
from ops_cuda.argmax import argmax_reference  # noqa: E402
from ops_cuda.gemv import gemv_reference  # noqa: E402
from ops_cuda.kv_cache import write_kv_cache_reference  # noqa: E402
from ops_cuda.kv_layout import is_key_minor, new_kv_cache, read_slots  # noqa: E402
from ops_cuda.norm import fused_add_rms_norm_reference, rms_norm_reference  # noqa: E402
from ops_cuda.rotary import apply_rotary_reference  # noqa: E402
from ops_cuda.triton_helpers import fullest_tile, resident_programs  # noqa: E402
from tests.conftest import poison_allocator  # noqa: E402


EPS = 1e-6
# Largest difference allowed, relative to the reference's largest magnitude. The interpreter
# computes in numpy (exactly rounded); compiled GPU code uses approximate exp/div/rsqrt.
INTERPRETER_TOL = {torch.float32: 1e-6, torch.float16: 1e-3}
GPU_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# A matrix-vector product accumulates in float32 and rounds once: half a unit of the output dtype
# (float32's sums differ from the reference's in order only).
GEMV_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}


def assert_close(ours: torch.Tensor, reference: torch.Tensor, tol: float):
    assert ours.shape == reference.shape and ours.dtype == reference.dtype
    scale = reference.abs().max().float().item()
    torch.testing.assert_close(ours.float(), reference.float(), rtol=tol, atol=tol * scale)


def rope_table(positions: torch.Tensor, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The layout layers.RotaryEmbedding produces: cos/sin of cat(freqs, freqs), float32.
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = positions[:, None].float() * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def qkv_views(n: int, q_heads: int, kv_heads: int, head_dim: int, dtype, device="cpu"):
    # q/k/v as the attention layer gets them: strided views into one fused projection output.
    qkv = torch.randn(n, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(n, q_heads, head_dim), k.view(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim)


def gemv_inputs(n: int, k: int, lead: tuple, bias: bool, dtype, device="cpu"):
    x = torch.randn(*lead, k, device=device).to(dtype)
    weight = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    return x, weight, torch.randn(n, device=device).to(dtype) if bias else None


def exact_gemv(x, weight, bias):
    return gemv_reference(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def exact_gated_gemv(x, weight, bias, activation):
    # The product exactly rounded, then the activation as the reference takes it.
    return act_and_mul_reference(exact_gemv(x, weight, bias), activation)


def logits_with_ties(rows: int, vocab: int, dtype, device="cpu", seed: int = 0) -> torch.Tensor:
    # Each row's maximum planted at three places (``seed`` picks them), so the first one must win;
    # with several rows, the last all -inf.
    logits = torch.randn(rows, vocab, device=device).to(dtype)
    for row in range(rows):
        places = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed * rows + row))[:3]
        logits[row, places] = logits[row].max() + 1
    if rows > 1:
        logits[-1] = float("-inf")
    return logits


def norm_inputs(case: str, dtype):
    if case == "strided_heads":  # q-norm over head_dim on a view of a fused qkv
        return qkv_views(5, 4, 2, 24, dtype)[0]
    shape = {"rows": (5, 72), "one_row": (1, 72), "heads": (5, 3, 24)}[case]
    return torch.randn(shape, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# CPU: the launchers under Triton's interpreter
# ---------------------------------------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", INTERPRETER_TOL)
@pytest.mark.parametrize("case", ["rows", "one_row", "heads", "strided_heads"])
def test_rms_norm_interpreted(case, dtype):
    torch.manual_seed(0)
    x = norm_inputs(case, dtype)
    weight = torch.randn(x.shape[-1], dtype=dtype)
    assert_close(kernels.rms_norm_triton(x, weight, EPS), rms_norm_reference(x, weight, EPS), INTERPRETER_TOL[dtype])


@pytest.mark.interpreter
def test_rms_norm_weight_dtype_promotes_interpreted():
    # float16 activations with a float32 weight give float32, as in the reference.
    torch.manual_seed(0)
    x, weight = torch.randn(5, 72, dtype=torch.float16), torch.randn(72)
    assert_close(kernels.rms_norm_triton(x, weight, EPS), rms_norm_reference(x, weight, EPS), 1e-6)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", INTERPRETER_TOL)
@pytest.mark.parametrize("case", ["rows", "one_row", "heads", "strided_heads"])
def test_fused_add_rms_norm_interpreted(case, dtype):
    torch.manual_seed(0)
    x, residual = norm_inputs(case, dtype), norm_inputs(case, dtype)
    weight = torch.randn(x.shape[-1], dtype=dtype)
    normed, summed = kernels.fused_add_rms_norm_triton(x, residual, weight, EPS)
    assert torch.equal(summed, residual + x)
    assert_close(normed, rms_norm_reference(residual + x, weight, EPS), INTERPRETER_TOL[dtype])


# (weight_offset, multiply_in_float32) of RMSNorm's variants besides Llama's.
NORM_VARIANTS = {"gemma": (1.0, True), "olmo2": (0.0, True), "offset-only": (1.0, False)}


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", INTERPRETER_TOL)
@pytest.mark.parametrize("case", ["rows", "strided_heads"])
@pytest.mark.parametrize("variant", NORM_VARIANTS)
def test_rms_norm_variants_interpreted(variant, case, dtype):
    torch.manual_seed(0)
    options = NORM_VARIANTS[variant]
    x, residual = norm_inputs(case, dtype), norm_inputs(case, dtype)
    weight = torch.randn(x.shape[-1], dtype=dtype) * 0.2  # an offset from one
    assert_close(kernels.rms_norm_triton(x, weight, EPS, *options), rms_norm_reference(x, weight, EPS, *options),
                 INTERPRETER_TOL[dtype])
    normed, summed = kernels.fused_add_rms_norm_triton(x, residual, weight, EPS, *options)
    assert torch.equal(summed, residual + x)
    assert_close(normed, rms_norm_reference(residual + x, weight, EPS, *options), INTERPRETER_TOL[dtype])


@pytest.mark.interpreter
def test_rms_norm_multiplied_in_float32_keeps_the_input_dtype_interpreted():
    # float16 activations with a float32 weight: Gemma's product is cast back to float16.
    torch.manual_seed(0)
    x, weight = torch.randn(5, 72, dtype=torch.float16), torch.randn(72) * 0.2
    out = kernels.rms_norm_triton(x, weight, EPS, 1.0, True)
    assert out.dtype == torch.float16
    assert_close(out, rms_norm_reference(x, weight, EPS, 1.0, True), INTERPRETER_TOL[torch.float16])


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", INTERPRETER_TOL)
@pytest.mark.parametrize("activation", sorted(GATED_ACTIVATIONS))
@pytest.mark.parametrize("shape", [(5, 2 * 40), (2, 3, 2 * 36)])
def test_act_and_mul_interpreted(shape, activation, dtype):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 4).to(dtype)  # reaches the saturated ends of each activation, and ±7 (clamps)
    assert_close(kernels.act_and_mul_triton(x, activation), act_and_mul_reference(x, activation), INTERPRETER_TOL[dtype])


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", INTERPRETER_TOL)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [24, 16, 8, 0], ids=["full", "partial16", "partial8", "nope"])
def test_apply_rotary_interpreted(rotary_dim, interleaved, dtype):
    torch.manual_seed(0)
    q, k, _ = qkv_views(5, 4, 2, 24, dtype)
    cos, sin = rope_table(torch.tensor([0, 1, 7, 30, 1000]), rotary_dim)
    ours = kernels.apply_rotary_triton(q, k, cos, sin, interleaved)
    reference = apply_rotary_reference(q, k, cos, sin, interleaved)
    for mine, theirs in zip(ours, reference):
        assert torch.equal(mine, theirs)


@pytest.mark.interpreter
@pytest.mark.parametrize("rotary_dim", [24, 16], ids=["full", "partial16"])
def test_apply_rotary_in_float32_interpreted(rotary_dim):
    # OLMo 2's rounding: the float32 cos and sin, each output rounded once. In float16, where the
    # interpreter rounds to nearest (bfloat16 it truncates).
    torch.manual_seed(0)
    q, k, _ = qkv_views(5, 4, 2, 24, torch.float16)
    cos, sin = rope_table(torch.tensor([0, 1, 7, 30, 1000]), rotary_dim)
    ours = kernels.apply_rotary_triton(q, k, cos, sin, False, True)
    for mine, theirs in zip(ours, apply_rotary_reference(q, k, cos, sin, False, True)):
        assert torch.equal(mine, theirs)
    assert not torch.equal(ours[0], apply_rotary_reference(q, k, cos, sin)[0])


@pytest.mark.interpreter
def test_apply_rotary_any_table_interpreted():
    # The neox kernel reads both halves of cos/sin, so it follows the reference on any table.
    torch.manual_seed(0)
    q, k = torch.randn(3, 4, 16), torch.randn(3, 1, 16)
    cos, sin = torch.randn(3, 16), torch.randn(3, 16)
    for mine, theirs in zip(kernels.apply_rotary_triton(q, k, cos, sin), apply_rotary_reference(q, k, cos, sin)):
        assert_close(mine, theirs, 1e-6)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", INTERPRETER_TOL)
def test_write_kv_cache_interpreted(dtype):
    torch.manual_seed(0)
    # 6 tokens over 3 blocks of 4 slots, two of them padding (slot -1); k/v strided views of a qkv.
    _, k, v = qkv_views(6, 4, 2, 24, dtype)
    k_cache = torch.randn(3, 4, 2, 24, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.tensor([0, 5, -1, 11, 2, -1])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_cache_reference(k, v, expected_k, expected_v, slots)
    kernels.write_kv_cache_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.interpreter
def test_write_kv_cache_head_dims_differ_interpreted():
    # k and v may have different head dims (MLA without absorption: 192 vs 128).
    torch.manual_seed(0)
    k, v = torch.randn(3, 2, 24), torch.randn(3, 2, 16)
    k_cache, v_cache = torch.zeros(2, 4, 2, 24), torch.zeros(2, 4, 2, 16)
    slots = torch.tensor([7, -1, 1], dtype=torch.int32)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_cache_reference(k, v, expected_k, expected_v, slots)
    kernels.write_kv_cache_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", INTERPRETER_TOL)
def test_write_fp8_kv_cache_interpreted(dtype):
    # Each value divided by its tensor's scale, saturated to +-448 and rounded to e4m3, as the reference does.
    torch.manual_seed(0)
    _, k, v = qkv_views(6, 4, 2, 24, dtype)
    k[0, 0, :3] = torch.tensor([1000.0, -1000.0, 447.0], dtype=dtype)  # past the range at scale 0.5: saturated
    k_cache, v_cache = (cache.zero_() for cache in new_kv_cache(3, 4, 2, 24, torch.float8_e4m3fn, "cpu"))
    assert is_key_minor(v_cache)
    slots = torch.tensor([0, 5, -1, 11, 2, -1])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_cache_reference(k, v, expected_k, expected_v, slots, 0.5, 2.0)
    kernels.write_kv_cache_triton(k, v, k_cache, v_cache, slots, 0.5, 2.0)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))
    assert expected_k[0, 0, 0, :3].float().tolist() == [448.0, -448.0, 448.0]
    # Read back: within e4m3's half a unit (2**-4 relative) of the value written.
    written = v[torch.tensor([0, 1, 3, 4])].float()
    read = read_slots(expected_v, torch.tensor([0, 5, 11, 2])).float() * 2.0
    torch.testing.assert_close(read, written, rtol=2**-4, atol=2**-9 * 2.0)


@pytest.mark.interpreter
def test_kv_write_kernels_reject_a_strided_cache_other_than_a_key_minor_v():
    _, k, v = qkv_views(6, 4, 2, 24, torch.float16)
    k_cache, v_cache = new_kv_cache(3, 4, 2, 24, torch.float8_e4m3fn, "cpu")
    cos, sin = torch.ones(6, 24, dtype=torch.float16), torch.zeros(6, 24, dtype=torch.float16)
    slots = torch.tensor([0, 5, -1, 11, 2, -1])
    dims_first = torch.zeros(3, 24, 4, 2, dtype=torch.float8_e4m3fn).permute(0, 2, 3, 1)  # unit stride on heads
    for bad_k, bad_v, culprit in ((v_cache, v_cache, "k_cache"), (k_cache, dims_first, "v_cache")):
        strides = re.escape(str((bad_k if culprit == "k_cache" else bad_v).stride()))
        with pytest.raises(ValueError, match=rf"zoo::write_kv_cache needs {culprit} .* got strides {strides}"):
            kernels.write_kv_cache_triton(k, v, bad_k, bad_v, slots)
        with pytest.raises(ValueError, match=rf"zoo::rotary_write_kv needs {culprit} .* got strides {strides}"):
            kernels.rotary_write_kv_triton(k, k, v, cos, sin, bad_k, bad_v, slots)


@pytest.mark.interpreter
def test_fp8_kv_cache_write_rounds_as_torch_interpreted():
    # Magnitudes from e4m3's subnormals (below 2**-6) to past its range, ties and signed zeros.
    torch.manual_seed(0)
    values = torch.randn(4096) * 10 ** torch.empty(4096).uniform_(-4, 3)
    values[:8] = torch.tensor([0.49, 1.0625, 1.1875, 3 * 2**-10, -3 * 2**-10, 2**-10, 0.0, -0.0])
    k = values.view(-1, 4, 64)
    k_cache = torch.zeros(len(k), 1, 4, 64, dtype=torch.float8_e4m3fn)
    slots = torch.arange(len(k))
    kernels.write_kv_cache_triton(k, k, k_cache, k_cache.clone(), slots)
    expected = values.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(k_cache.view(torch.uint8).flatten(), expected.view(torch.uint8))


def test_importing_zoo_does_not_import_triton():
    # Not torch's inductor either, which imports triton where it is installed.
    code = ("import sys, ops_cuda, layers, loaders, models, runtime, runtime.cli; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", INTERPRETER_TOL)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("n, k, lead", [(37, 100, (1,)), (16, 1030, (1, 1)), (8, 512, ())])
def test_gemv_interpreted(n, k, lead, bias, dtype):
    torch.manual_seed(0)
    x, weight, b = gemv_inputs(n, k, lead, bias, dtype)
    assert_close(kernels.gemv_triton(x, weight, b), exact_gemv(x, weight, b), GEMV_TOL[dtype])


@pytest.mark.interpreter
@pytest.mark.parametrize("rows", kernels.GEMV_ROWS)
def test_gemv_rows_interpreted(rows):
    # Each tile zoo::gemv picks from on a GPU; N = 37 leaves the last program's rows partial.
    torch.manual_seed(0)
    x, weight, bias = gemv_inputs(37, 100, (1,), True, torch.float16)
    assert_close(kernels.gemv_triton(x, weight, bias, rows=rows), exact_gemv(x, weight, bias), GEMV_TOL[torch.float16])


def test_gemv_rows_fill_whole_waves():
    # The Llama-3.1-8B products, with the programs an H200's 132 SMs hold at once of gemv_kernel
    # compiled by Triton 3.9 for 2, 4 and 8 rows (40, 64 and 117 registers: 12, 8 and 4 per SM).
    slots = {2: 12 * 132, 4: 8 * 132, 8: 4 * 132}

    def pick(n):
        return fullest_tile(kernels.GEMV_ROWS, lambda rows: -(-n // rows), slots.get, kernels.GEMV_BLOCK_N)

    assert pick(6144) == 2  # qkv_proj: 1.94 waves of 2 rows; 1.45 of 4 and of 8
    assert pick(4096) == 4  # o_proj, down_proj: 0.97 waves of 4 and of 8 (a tie: the default); 1.29 of 2
    assert pick(128256) == 2  # LM head: 40.48 waves of 2 rows, 30.36 of 4 and of 8
    assert fullest_tile((2, 4), lambda tile: 10, lambda tile: 10, 4) == 4  # every slot busy either way


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_float32_logits_interpreted(dtype):
    # A router's logits: the float32 product of the widened operands, as F.linear(x.float(), W.float()).
    torch.manual_seed(0)
    x, weight, _ = gemv_inputs(40, 300, (1,), False, dtype)
    out = kernels.gemv_triton(x, weight, None, torch.float32)
    assert out.dtype == torch.float32
    assert_close(out, torch.nn.functional.linear(x.float(), weight.float()), GEMV_TOL[torch.float32])


@pytest.mark.interpreter
def test_gemv_out_dtype_is_the_inputs_or_float32_interpreted():
    x, weight, _ = gemv_inputs(8, 16, (1,), False, torch.bfloat16)
    with pytest.raises(ValueError, match="zoo::gemv writes torch.bfloat16 or float32, not torch.float16"):
        kernels.gemv_triton(x, weight, None, torch.float16)


@pytest.mark.interpreter
def test_gemv_takes_one_row_interpreted():
    with pytest.raises(ValueError, match=r"zoo::gemv multiplies one row: x has shape \(2, 8\)"):
        kernels.gemv_triton(torch.randn(2, 8), torch.randn(4, 8), None)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", INTERPRETER_TOL)
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
def test_gated_gemv_activations_interpreted(activation, dtype):
    # I = 37 columns of h: the last tile of 2 half full; K = 100 in one masked tile.
    torch.manual_seed(0)
    x, weight, bias = gemv_inputs(2 * 37, 100, (1,), True, dtype)
    out = kernels.gated_gemv_triton(x, weight, bias, activation)
    assert_close(out, exact_gated_gemv(x, weight, bias, activation), GEMV_TOL[dtype])


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", INTERPRETER_TOL)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("intermediate, k, lead", [(37, 1030, (1, 1)), (8, 512, ()), (3, 7, (1,))])
def test_gated_gemv_interpreted(intermediate, k, lead, bias, dtype):
    # K = 1030: a full tile of 1,024 columns and a masked one.
    torch.manual_seed(0)
    x, weight, b = gemv_inputs(2 * intermediate, k, lead, bias, dtype)
    out = kernels.gated_gemv_triton(x, weight, b, "silu")
    assert out.shape == (*lead, intermediate)
    assert_close(out, exact_gated_gemv(x, weight, b, "silu"), GEMV_TOL[dtype])


@pytest.mark.interpreter
@pytest.mark.parametrize("block_n, block_k", [(1, 16), (4, 32), (16, 64)])
def test_gated_gemv_tiles_interpreted(block_n, block_k):
    # The tiles benchmarks/bench_gemv.py sweeps: I = 37 and K = 100 leave each one's last tiles partial.
    torch.manual_seed(0)
    x, weight, bias = gemv_inputs(2 * 37, 100, (1,), True, torch.float16)
    out = kernels.gated_gemv_triton(x, weight, bias, "gelu_pytorch_tanh", block_n, block_k, num_warps=2)
    assert_close(out, exact_gated_gemv(x, weight, bias, "gelu_pytorch_tanh"), GEMV_TOL[torch.float16])


@pytest.mark.interpreter
def test_gated_gemv_rejects_bad_inputs_interpreted():
    x, weight, bias = gemv_inputs(8, 16, (1,), True, torch.float16)
    with pytest.raises(ValueError, match=r"zoo::gated_gemv multiplies one row: x has shape \(2, 16\)"):
        kernels.gated_gemv_triton(torch.cat([x, x]), weight, None, "silu")
    with pytest.raises(ValueError, match=r"gate rows then as many up rows, got shape \(7, 16\)"):
        kernels.gated_gemv_triton(x, weight[:7], None, "silu")
    with pytest.raises(ValueError, match=r"a bias of 8 values for a weight of shape \(8, 16\), got shape \(4,\)"):
        kernels.gated_gemv_triton(x, weight, bias[:4], "silu")
    with pytest.raises(ValueError, match="unsupported activation 'tanh'"):
        kernels.gated_gemv_triton(x, weight, None, "tanh")
    with pytest.raises(TypeError, match="zoo::gated_gemv takes one of"):
        kernels.gated_gemv_triton(x, weight.float(), None, "silu")


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", INTERPRETER_TOL)
@pytest.mark.parametrize("rows, vocab", [(3, 1000), (2, 9000), (1, 7)])
def test_argmax_interpreted(rows, vocab, dtype):
    torch.manual_seed(0)
    logits = logits_with_ties(rows, vocab, dtype)
    assert torch.equal(kernels.argmax_triton(logits), logits.argmax(-1))


# ---------------------------------------------------------------------------------------------
# GPU: the registered ops on CUDA tensors, eager and under CUDA-graph capture
# ---------------------------------------------------------------------------------------------


def as_tuple(outputs) -> tuple:
    return () if outputs is None else outputs if isinstance(outputs, tuple) else (outputs,)


def run_poisoned(op, *args):
    """op(*args) with every block PyTorch's allocator holds poisoned (``poison_allocator``), whatever
    buffers the op allocates before its outputs: an output element left unwritten reads NaN, or -1."""
    poison_allocator()
    return op(*args)


def replay_in_graph(op, args, new_args, check) -> None:
    """Captures op(*args) in a CUDA graph and replays it over two sets of values in the captured
    tensors: ``args``' own, then ``new_args``' (same shapes and constants, other values: other
    positions, slots, weights) copied into them in place, as a decode step rewrites its buffers
    before each replay. The inputs are snapshotted (cloned) before each replay, so buffers the op
    writes in place hold what they held before it; after it, ``check(outputs, snapshot)`` compares
    the graph's outputs, and whatever it wrote in place, with the reference run on the snapshot.
    A graph that kept values from its capture (read on the host, copied or cached) fails the check
    of the second set. Each set is replayed twice: both replays must agree."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and load the kernel outside the capture
        op(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = as_tuple(op(*args))
    captured_outputs = None
    for values in (args, new_args):
        for old, new in zip(args, values, strict=True):
            if torch.is_tensor(old):
                old.copy_(new)
            else:  # a constant baked into the graph: the same in both sets
                assert old == new, (old, new)
        snapshot = [a.clone() if torch.is_tensor(a) else a for a in args]
        graph.replay()
        first = [t.clone() for t in outputs]
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(first, outputs)), "two replays differ"
        check(outputs, snapshot)
        if captured_outputs is not None and outputs:  # else the new values would test nothing
            changed = any(not torch.equal(a, b) for a, b in zip(captured_outputs, outputs))
            assert changed, "the new values gave the captured values' outputs"
        captured_outputs = first


GPU_NORM_CASES = {
    "rows": lambda dtype: torch.randn(37, 5120 + 72, dtype=dtype, device="cuda"),
    "one_row": lambda dtype: torch.randn(1, 4096, dtype=dtype, device="cuda"),
    "many_rows": lambda dtype: torch.randn(4099, 896, dtype=dtype, device="cuda"),
    "odd_hidden": lambda dtype: torch.randn(5, 72, dtype=dtype, device="cuda"),
    "strided_heads": lambda dtype: qkv_views(33, 32, 8, 128, dtype, "cuda")[1],
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_TOL)
@pytest.mark.parametrize("case", GPU_NORM_CASES)
def test_rms_norm_gpu(case, dtype):
    torch.manual_seed(0)
    x, residual = GPU_NORM_CASES[case](dtype), GPU_NORM_CASES[case](dtype)
    weight = torch.randn(x.shape[-1], dtype=dtype, device="cuda")
    assert_close(run_poisoned(rms_norm, x, weight, EPS), rms_norm_reference(x, weight, EPS), GPU_TOL[dtype])
    normed, summed = run_poisoned(fused_add_rms_norm, x, residual, weight, EPS)
    expected_normed, expected_summed = fused_add_rms_norm_reference(x, residual, weight, EPS)
    assert torch.equal(summed, expected_summed)
    assert_close(normed, expected_normed, GPU_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_TOL)
@pytest.mark.parametrize("variant", NORM_VARIANTS)
def test_rms_norm_variants_gpu(variant, dtype):
    torch.manual_seed(0)
    options = NORM_VARIANTS[variant]
    x, residual = GPU_NORM_CASES["rows"](dtype), GPU_NORM_CASES["rows"](dtype)
    weight = (torch.randn(x.shape[-1], device="cuda") * 0.2).to(dtype)
    assert_close(run_poisoned(rms_norm, x, weight, EPS, *options), rms_norm_reference(x, weight, EPS, *options),
                 GPU_TOL[dtype])
    normed, summed = run_poisoned(fused_add_rms_norm, x, residual, weight, EPS, *options)
    expected_normed, expected_summed = fused_add_rms_norm_reference(x, residual, weight, EPS, *options)
    assert torch.equal(summed, expected_summed)
    assert_close(normed, expected_normed, GPU_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_TOL)
@pytest.mark.parametrize("activation", sorted(GATED_ACTIVATIONS))
@pytest.mark.parametrize("shape", [(1, 2 * 14336), (300, 2 * 1000 + 2), (2, 3, 2 * 36)])
def test_act_and_mul_gpu(shape, activation, dtype):
    torch.manual_seed(0)
    x = (torch.randn(shape, device="cuda") * 4).to(dtype)
    assert_close(run_poisoned(act_and_mul, x, activation), act_and_mul_reference(x, activation), GPU_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_TOL)
@pytest.mark.parametrize("rotate_in_float32", [False, True], ids=["rounded_angles", "float32_rotation"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize(
    "n, q_heads, kv_heads, head_dim, rotary_dim",
    [(1, 32, 8, 128, 128), (4097, 32, 8, 128, 128), (37, 28, 4, 128, 64), (5, 16, 1, 64, 64), (9, 6, 2, 80, 32),
     (37, 16, 4, 128, 0)],  # a NoPE layer (SmolLM3's): no channel rotates
)
def test_apply_rotary_gpu(n, q_heads, kv_heads, head_dim, rotary_dim, interleaved, rotate_in_float32, dtype):
    # Bit-equal, not merely close: a unit off in a sixth of the bf16 outputs (a fused multiply-add
    # skipping a rounding) cost zoo's bf16 logits 2% of top-1 agreement with HF.
    torch.manual_seed(0)
    q, k, _ = qkv_views(n, q_heads, kv_heads, head_dim, dtype, "cuda")
    cos, sin = rope_table(torch.randint(0, 32768, (n,), device="cuda"), rotary_dim)
    ours = run_poisoned(apply_rotary, q, k, cos, sin, interleaved, rotate_in_float32)
    for mine, theirs in zip(ours, apply_rotary_reference(q, k, cos, sin, interleaved, rotate_in_float32)):
        assert torch.equal(mine, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_TOL)
def test_write_kv_cache_gpu(dtype):
    torch.manual_seed(0)
    n, kv_heads, head_dim, block_size, num_blocks = 300, 8, 128, 16, 64
    _, k, v = qkv_views(n, 32, kv_heads, head_dim, dtype, "cuda")
    # NaN caches: a slot the kernel misses, or a padding token it writes, shows against the reference.
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device="cuda")
    v_cache = k_cache.clone()
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:n]
    slots[::7] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_cache_reference(k, v, expected_k, expected_v, slots)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_TOL)
def test_write_fp8_kv_cache_gpu(dtype):
    torch.manual_seed(0)
    n, kv_heads, head_dim, block_size, num_blocks = 300, 8, 128, 16, 64
    _, k, v = qkv_views(n, 32, kv_heads, head_dim, dtype, "cuda")
    k.mul_(300)  # some values past the range at scale 0.5: saturated
    k[1, 0, :2] = v[2, 3, 5] = float("nan")  # written as NaN (0x7f), as torch's clamp keeps it, not as -448
    # NaN caches (0x7f in e4m3), V key-minor as the runtime's: a slot the kernel misses, or a padding
    # token it writes, shows.
    k_cache, v_cache = new_kv_cache(num_blocks, block_size, kv_heads, head_dim, torch.float8_e4m3fn, "cuda")
    for cache in (k_cache, v_cache):
        cache.view(torch.uint8).fill_(0x7F)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:n]
    slots[::7] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_cache_reference(k, v, expected_k, expected_v, slots, 0.5, 2.0)
    write_kv_cache(k, v, k_cache, v_cache, slots, 0.5, 2.0)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336), (1000, 1003), (128256, 64)])
def test_gemv_gpu(n, k, bias, dtype):
    torch.manual_seed(0)
    x, weight, b = gemv_inputs(n, k, (1,), bias, dtype, "cuda")
    assert_close(run_poisoned(gemv, x, weight, b), exact_gemv(x, weight, b), GEMV_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", kernels.GEMV_ROWS)
def test_gemv_rows_gpu(rows):
    torch.manual_seed(0)
    x, weight, _ = gemv_inputs(6144, 4096, (1,), False, torch.bfloat16, "cuda")
    out = kernels.gemv_triton(x, weight, None, rows=rows)
    assert_close(out, exact_gemv(x, weight, None), GEMV_TOL[torch.bfloat16])
    # Every SM holds at least one of its programs, and at most its threads' worth (2,048 / 128).
    args, options = kernels.gemv_launch(x, weight, None, None)
    compiled = kernels.gemv_kernel.warmup(*args, BLOCK_N=rows, grid=(1,), **options)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    assert sms <= resident_programs(compiled, x.device) <= 16 * sms


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(128, 2048), (256, 7168)])  # Qwen3-30B-A3B's and DeepSeek-V3's routers
def test_gemv_float32_logits_gpu(n, k):
    torch.manual_seed(0)
    x, weight, _ = gemv_inputs(n, k, (1,), False, torch.bfloat16, "cuda")
    out = run_poisoned(gemv, x, weight, None, torch.float32)
    assert out.dtype == torch.float32
    exact = torch.nn.functional.linear(x.double(), weight.double()).float()
    assert_close(out, exact, GEMV_TOL[torch.float32])


@pytest.mark.gpu
def test_linear_sends_single_rows_to_gemv(monkeypatch):
    torch.manual_seed(0)
    x, weight, bias = gemv_inputs(300, 256, (4,), True, torch.bfloat16, "cuda")
    sent = []
    monkeypatch.setattr(ops_cuda.linear, "gemv", lambda *args: sent.append(args) or gemv(*args))
    linear = ops_cuda.linear.linear
    assert torch.equal(linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias))
    assert not sent
    assert torch.equal(linear(x[:1], weight, bias), gemv(x[:1], weight, bias))
    assert len(sent) == 1
    column_major = weight.t().contiguous().t()  # a CPU-loaded Linear's layout, moved to the GPU
    assert torch.equal(linear(x[:1], column_major, bias), torch.nn.functional.linear(x[:1], column_major, bias))
    assert len(sent) == 1
    assert torch.equal(linear(x[:1], weight, None, out_dtype=torch.float32), gemv(x[:1], weight, None, torch.float32))
    assert len(sent) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("intermediate, k", [(14336, 4096), (1001, 1003)])  # Llama-3.1-8B's MLP; odd sizes
def test_gated_gemv_gpu(intermediate, k, bias, activation, dtype):
    torch.manual_seed(0)
    x, weight, b = gemv_inputs(2 * intermediate, k, (1,), bias, dtype, "cuda")
    out = run_poisoned(gated_gemv, x, weight, b, activation)
    assert_close(out, exact_gated_gemv(x, weight, b, activation), GEMV_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_TOL)
@pytest.mark.parametrize("rows, vocab", [(1, 128256), (451, 151936), (5, 32000), (0, 100)])
def test_argmax_gpu(rows, vocab, dtype):
    torch.manual_seed(0)
    logits = logits_with_ties(rows, vocab, dtype, "cuda") if rows else torch.randn(0, vocab, device="cuda").to(dtype)
    assert torch.equal(run_poisoned(argmax, logits), logits.argmax(-1))


def gpu_op_cases(seed: int = 0) -> dict:
    """name -> (op, reference, args): one bf16 call of each op, shaped like a decode batch of 33;
    ``seed`` draws the values (the positions and the cache slots too), not the shapes."""
    torch.manual_seed(seed)
    q, k, v = qkv_views(33, 32, 8, 128, torch.bfloat16, "cuda")
    x = torch.randn(33, 4096, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    cos, sin = rope_table(torch.randint(0, 32768, (33,), device="cuda"), 64)
    k_cache, v_cache = torch.zeros(2, 8, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(8 * 16, device="cuda")[:33]  # distinct slots of the 8 blocks of 16
    slots[-3:] = -1  # padding rows of a captured batch
    return {
        "rms_norm": (rms_norm, rms_norm_reference, (x, weight, EPS)),
        "qk_norm": (rms_norm, rms_norm_reference, (q, weight[:128], EPS)),
        "fused_add_rms_norm": (fused_add_rms_norm, fused_add_rms_norm_reference, (x, x * 0.5, weight, EPS)),
        "act_and_mul": (act_and_mul, act_and_mul_reference, (x, "silu")),
        "apply_rotary": (apply_rotary, apply_rotary_reference, (q, k, cos, sin, False)),
        "apply_rotary_interleaved": (apply_rotary, apply_rotary_reference, (q, k, cos, sin, True)),
        "write_kv_cache": (write_kv_cache, write_kv_cache_reference, (k, v, k_cache, v_cache, slots)),
        "gemv": (gemv, exact_gemv, gemv_inputs(4096, 4096, (1,), True, torch.bfloat16, "cuda")),
        "gated_gemv": (gated_gemv, exact_gated_gemv,
                       (*gemv_inputs(2 * 14336, 4096, (1,), False, torch.bfloat16, "cuda"), "silu")),
        "argmax": (argmax, argmax_reference, (logits_with_ties(33, 128256, torch.bfloat16, "cuda", seed),)),
    }


OP_CASES = [
    "rms_norm", "qk_norm", "fused_add_rms_norm", "act_and_mul", "apply_rotary", "apply_rotary_interleaved", "write_kv_cache",
    "gemv", "gated_gemv", "argmax",
]


@pytest.mark.gpu
@pytest.mark.parametrize("name", OP_CASES)
def test_ops_in_cuda_graph(name):
    """Each op captured once, replayed over its captured inputs and over new values written into
    them (``replay_in_graph``): every replay matches the reference on the values it read."""
    op, reference, args = gpu_op_cases(seed=0)[name]
    new_args = gpu_op_cases(seed=1)[name][2]

    def check(outputs, inputs):
        if op is write_kv_cache:  # compare the caches it wrote in place
            k, v, expected_k, expected_v, slots = inputs
            reference(k, v, expected_k, expected_v, slots)
            assert torch.equal(args[2], expected_k) and torch.equal(args[3], expected_v)
            return
        for mine, theirs in zip(outputs, as_tuple(reference(*inputs)), strict=True):
            if theirs.dtype == torch.int64:  # indices
                assert torch.equal(mine, theirs)
            else:
                assert_close(mine, theirs, GPU_TOL[torch.bfloat16])

    replay_in_graph(op, args, new_args, check)


@pytest.mark.gpu
@pytest.mark.parametrize("name", OP_CASES)
def test_fake_kernels_match_cuda_kernels(name):
    # torch.compile traces with the fake kernels: they must give the CUDA kernels' shapes, dtypes and strides.
    op, _, args = gpu_op_cases()[name]
    torch.library.opcheck(getattr(torch.ops.zoo, op.__name__), args, test_utils=("test_schema", "test_faketensor"))
