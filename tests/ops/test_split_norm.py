"""An RMSNorm split between the single-row products around it (ops_cuda.gemv): zoo::gemv_into_norm
before it, zoo::normed_gemv or zoo::normed_gated_gemv after it. Their kernels against the references
and the exactly rounded products (in Triton's interpreter on the CPU, as they run on a GPU), and a
decoder that splits its norms against HF's.
"""

import pytest
import torch

pytest.importorskip("triton")

import layers.linear  # noqa: E402
import layers.mlp  # noqa: E402
import layers.moe  # noqa: E402
import layers.norm  # noqa: E402
import models.base  # noqa: E402
import ops_cuda.linear  # noqa: E402
from models import AutoModelForCausalLM  # noqa: E402
from ops_cuda import gemv_into_norm, normed_gated_gemv, normed_gemv  # noqa: E402
from ops_cuda import triton_kernels as kernels  # noqa: E402
from ops_cuda.activation import act_and_mul_reference  # noqa: E402
from ops_cuda.dispatch import NORM_SLOTS  # noqa: E402
from ops_cuda.gemv import normed_gated_gemv_reference, normed_gemv_reference  # noqa: E402
from ops_cuda.moe_decode import moe_experts_decode, moe_experts_token_into_norm  # noqa: E402
from ops_cuda.norm import fused_add_rms_norm_reference  # noqa: E402
from tests.conftest import relative_error, tiny_config  # noqa: E402

EPS = 1e-5
# A product accumulated in float32 and rounded once (tests/ops/test_triton_ops.py's GEMV_TOL).
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}


def split_inputs(hidden: int, k: int, n: int, dtype, bias: bool, device="cpu"):
    """The product before the norm (x [1, k] times W [hidden, k], the residual [1, hidden], the norm's
    weight) and the weight [n, hidden] of the product after it."""
    torch.manual_seed(0)
    x = torch.randn(1, k, device=device).to(dtype)
    before = (torch.randn(hidden, k, device=device) / k**0.5).to(dtype)
    residual = torch.randn(1, hidden, device=device).to(dtype)
    norm_weight = (1 + 0.3 * torch.randn(hidden, device=device)).to(dtype)
    after = (torch.randn(n, hidden, device=device) / hidden**0.5).to(dtype)
    after_bias = torch.randn(n, device=device).to(dtype) if bias else None
    return x, before, residual, norm_weight, after, after_bias


def new_stats(device="cpu") -> torch.Tensor:
    return torch.zeros(NORM_SLOTS, dtype=torch.float64, device=device)


def exact_normed(summed: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    # The normalised row in float64, never rounded.
    summed = summed.double()
    return summed * torch.rsqrt(summed.square().mean(-1, keepdim=True) + EPS) * norm_weight.double()


def exact_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def assert_close(ours: torch.Tensor, expected: torch.Tensor, tol: float):
    assert ours.dtype == expected.dtype and ours.shape == expected.shape
    torch.testing.assert_close(ours.float(), expected.float(), rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("rows", kernels.GEMV_ROWS)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_gemv_into_norm_interpreted(bias, rows, dtype):
    # hidden = 37 leaves the last program's rows partial; K = 1030 takes two tiles, the second masked.
    x, weight, residual, norm_weight, _, _ = split_inputs(37, 1030, 8, dtype, False)
    b = torch.randn(37).to(dtype) if bias else None
    stats = new_stats()
    summed, weighted = kernels.gemv_into_norm_triton(x, weight, b, residual, norm_weight, stats, rows=rows)
    expected = (exact_product(x, weight, b).to(dtype).double() + residual.double()).to(dtype)
    assert_close(summed, expected, TOL[dtype])
    assert torch.equal(weighted, (summed.float() * norm_weight.float()).to(dtype))
    # each program's sum in its slot: program p's in slot p % NORM_SLOTS, the others untouched
    programs = -(-37 // rows)
    assert torch.count_nonzero(stats) == min(programs, NORM_SLOTS)
    assert stats.sum().item() == pytest.approx(summed.double().square().sum().item(), rel=1e-6)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_normed_products_interpreted(bias, dtype):
    # The norm's 1 / rms from four programs' partial sums; n = 37 rows after, h = 37 / 2 columns gated.
    x, before, residual, norm_weight, after, after_bias = split_inputs(64, 48, 74, dtype, bias)
    stats = new_stats()
    summed, weighted = kernels.gemv_into_norm_triton(x, before, None, residual, norm_weight, stats, rows=16)
    normed = exact_normed(summed, norm_weight)
    out = kernels.normed_gemv_triton(weighted, stats, EPS, after, after_bias)
    assert_close(out, exact_product(normed, after, after_bias).to(dtype), TOL[dtype])
    assert_close(out, normed_gemv_reference(weighted, stats, EPS, after, after_bias), TOL[dtype])
    h = kernels.normed_gated_gemv_triton(weighted, stats, EPS, after, after_bias, "silu")
    exact_h = act_and_mul_reference(exact_product(normed, after, after_bias).to(dtype), "silu")
    assert_close(h, exact_h, 2 * TOL[dtype])
    assert_close(h, normed_gated_gemv_reference(weighted, stats, EPS, after, after_bias, "silu"),
                 2 * TOL[dtype])


def test_split_references_are_the_norm_then_the_product():
    # On the CPU: the split ops against RMSNorm's reference, then the product, in float32.
    x, before, residual, norm_weight, after, after_bias = split_inputs(64, 48, 74, torch.float32, True)
    stats = new_stats()
    summed, weighted = gemv_into_norm(x, before, None, residual, norm_weight, stats)
    normed, expected_summed = fused_add_rms_norm_reference(x @ before.T, residual, norm_weight, EPS)
    assert torch.equal(summed, expected_summed)
    assert_close(normed_gemv(weighted, stats, EPS, after, after_bias), normed @ after.T + after_bias, 1e-5)
    expected_h = act_and_mul_reference(normed @ after.T + after_bias, "gelu_pytorch_tanh")
    assert_close(normed_gated_gemv(weighted, stats, EPS, after, after_bias, "gelu_pytorch_tanh"), expected_h, 1e-5)


@pytest.mark.interpreter
def test_normed_products_take_only_a_split_norms_outputs():
    x, before, residual, norm_weight, after, _ = split_inputs(64, 48, 74, torch.float16, False)
    stats = new_stats()
    _, weighted = kernels.gemv_into_norm_triton(x, before, None, residual, norm_weight, stats)
    with pytest.raises(ValueError, match="zoo::normed_gemv takes a split norm's 32 float64 sums of squares"):
        kernels.normed_gemv_triton(weighted, stats.float(), EPS, after, None)
    with pytest.raises(ValueError, match="zoo::normed_gated_gemv takes a split norm's 32 float64 sums"):
        kernels.normed_gated_gemv_triton(weighted, stats[:16], EPS, after, None, "silu")
    with pytest.raises(ValueError, match=r"zoo::gemv_into_norm .* norm weight \(63,\)"):
        kernels.gemv_into_norm_triton(x, before, None, residual, norm_weight[:63], stats)


def split_as_on_a_gpu(monkeypatch) -> list:
    """Every single row takes the GPU's branch, its products run by the kernels in the interpreter;
    returns the list of the kernels called, by name."""
    called = []

    def recorded(kernel):
        return lambda *args: called.append(kernel.__name__) or kernel(*args)

    for module in (layers.linear, layers.mlp, ops_cuda.linear):
        monkeypatch.setattr(module, "takes_gemv", lambda x, weight: x.shape[0] == 1)
    monkeypatch.setattr(ops_cuda.linear, "gemv", recorded(kernels.gemv_triton))
    monkeypatch.setattr(layers.mlp, "gated_gemv", recorded(kernels.gated_gemv_triton))
    monkeypatch.setattr(layers.norm, "gemv_into_norm", recorded(kernels.gemv_into_norm_triton))
    monkeypatch.setattr(layers.linear, "normed_gemv", recorded(kernels.normed_gemv_triton))
    monkeypatch.setattr(layers.mlp, "normed_gated_gemv", recorded(kernels.normed_gated_gemv_triton))
    monkeypatch.setattr(layers.moe, "normed_gemv", recorded(kernels.normed_gemv_triton))

    def normed_moe_experts_kernel(weighted, stats, eps, *experts):
        return moe_experts_decode(weighted, *experts, norm=(stats, eps))

    def normed_moe_experts_into_norm_kernel(weighted, stats, eps, *args):
        *experts, residual, norm_weight, next_stats = args
        return moe_experts_token_into_norm(weighted, *experts, (stats, eps), (residual, norm_weight, next_stats))

    monkeypatch.setattr(layers.moe, "normed_moe_experts", recorded(normed_moe_experts_kernel))
    monkeypatch.setattr(layers.moe, "normed_moe_experts_into_norm", recorded(normed_moe_experts_into_norm_kernel))
    monkeypatch.setattr(models.base.DecoderModel, "split_norm_stats", lambda model, hidden_states: (
        layers.norm.new_norm_stats((len(model.layers), 2), hidden_states.device) if len(hidden_states) == 1 else None))
    return called


# Three layers each. Llama: the pre-MLP norms and the second and third pre-attention norms are split;
# the first pre-attention norm (after the embedding) and the final norm are not. Qwen3-MoE, a dense
# layer then two sparse ones: the sparse layers' pre-MLP norms are split into the router's logits and
# the experts' gate_up; the second layer's pre-attention norm follows the dense down_proj, the third's
# the second layer's experts.
SPLIT_MODELS = {
    "llama": ({}, {"gemv_into_norm_triton": 5, "normed_gated_gemv_triton": 3, "normed_gemv_triton": 2,
                   "gated_gemv_triton": 0}),
    "qwen3_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                       mlp_only_layers=[0]),
                  {"gemv_into_norm_triton": 4, "normed_moe_experts_into_norm_kernel": 1,
                   "normed_moe_experts_kernel": 1, "normed_gemv_triton": 4,
                   "normed_gated_gemv_triton": 1}),  # o_proj x3 + down_proj; routers x2 + qkv_proj x2
}


@pytest.mark.interpreter
@pytest.mark.parametrize("arch", SPLIT_MODELS)
def test_splits_its_norms_on_one_row_as_hf_computes(monkeypatch, make_checkpoint, arch):
    fields, calls = SPLIT_MODELS[arch]
    path, reference = make_checkpoint(tiny_config(arch, num_hidden_layers=3, **fields))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    token = torch.tensor([[5]])
    with torch.no_grad():
        expected = reference(token).logits
        called = split_as_on_a_gpu(monkeypatch)
        ours = model(token)
    assert {kernel: called.count(kernel) for kernel in calls} == calls
    assert relative_error(ours, expected) < 1e-5


def test_only_blocks_of_attention_and_gated_mlp_between_plain_rmsnorms_split(make_checkpoint):
    llama = AutoModelForCausalLM.from_pretrained(make_checkpoint(tiny_config("llama"))[0])
    first, last = llama.model.layers
    assert first.splits_norms and last.splits_norms
    assert first.self_attn.o_proj.into_norm and first.mlp.down_proj.into_norm
    assert last.self_attn.o_proj.into_norm and not last.mlp.down_proj.into_norm  # the final norm's input
    gemma = AutoModelForCausalLM.from_pretrained(make_checkpoint(tiny_config("gemma", head_dim=16))[0])
    assert not any(layer.splits_norms for layer in gemma.model.layers)  # its norms multiply by 1 + weight
    moe = AutoModelForCausalLM.from_pretrained(make_checkpoint(tiny_config(
        "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
        mlp_only_layers=[0], num_hidden_layers=3))[0])
    dense, sparse, last_sparse = moe.model.layers
    assert all(layer.splits_norms for layer in moe.model.layers)  # a plain softmax router, no shared expert
    assert dense.mlp.down_proj.into_norm  # into the sparse block's pre-attention norm
    assert all(layer.self_attn.o_proj.into_norm for layer in moe.model.layers)  # into the router and experts
    assert sparse.mlp.into_norm and not last_sparse.mlp.into_norm  # the experts into the next block's norm
    qwen2_moe = AutoModelForCausalLM.from_pretrained(make_checkpoint(tiny_config(
        "qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32))[0])
    assert not any(layer.splits_norms for layer in qwen2_moe.model.layers)  # its shared expert reads the row too
    assert not any(getattr(module, "into_norm", False) for module in qwen2_moe.modules())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_split_norm_kernels_gpu(dtype):
    # The Llama-3.1-8B shapes: o_proj into the pre-MLP norm, then gate_up; the same bits every run.
    x, before, residual, norm_weight, after, _ = split_inputs(4096, 4096, 2 * 14336, dtype, False, "cuda")
    stats = new_stats("cuda")
    summed, weighted = gemv_into_norm(x, before, None, residual, norm_weight, stats)
    expected_summed = (exact_product(x, before, None).to(dtype).double() + residual.double()).to(dtype)
    assert_close(summed, expected_summed, TOL[dtype])
    assert torch.equal(weighted, (summed.float() * norm_weight.float()).to(dtype))
    normed = exact_normed(summed, norm_weight)
    h = normed_gated_gemv(weighted, stats, EPS, after, None, "silu")
    assert_close(h, act_and_mul_reference(exact_product(normed, after, None).to(dtype), "silu"), 2 * TOL[dtype])
    out = normed_gemv(weighted, stats, EPS, after[:6144], None)
    assert_close(out, exact_product(normed, after[:6144], None).to(dtype), TOL[dtype])
    for _ in range(20):
        again = new_stats("cuda")
        assert all(torch.equal(a, b) for a, b in zip(gemv_into_norm(x, before, None, residual, norm_weight, again),
                                                     (summed, weighted)))
        assert torch.equal(normed_gated_gemv(weighted, again, EPS, after, None, "silu"), h)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", SPLIT_MODELS)
def test_splits_its_norms_on_one_row_gpu(make_checkpoint, arch):
    # bfloat16 on the GPU: one token's logits split as batch-1 decode computes them, and unsplit.
    fields, _ = SPLIT_MODELS[arch]
    path, reference = make_checkpoint(tiny_config(arch, num_hidden_layers=3, **fields), dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    token = torch.tensor([[5]], device="cuda")
    with torch.no_grad():
        split = model(token).float()
        for module in model.modules():
            if isinstance(module, layers.Linear):
                module.into_norm = False
        unsplit = model(token).float()
        expected = reference.cuda()(token).logits
    assert relative_error(split, expected) < 2e-2 and relative_error(unsplit, expected) < 2e-2
    assert relative_error(split, unsplit) < 2e-2


@pytest.mark.gpu
def test_batch_1_decode_graphs_split_the_norms_and_follow_hf():
    # One prompt at a time through the runtime: each decode step a single row, replayed as a CUDA graph
    # with the norms split; HF's greedy tokens and the runtime's with the norms unsplit as references.
    from models.base import norms_unsplit
    from runtime import LLM, SamplingParams
    from tests.runtime.test_gpu_runtime import SMALL, random_hf

    reference = random_hf(tiny_config("llama", **SMALL))
    model = AutoModelForCausalLM.from_hf(reference)
    torch.manual_seed(2)
    prompts = [torch.randint(0, 4096, (n,)).tolist() for n in (5, 37, 100)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(model, max_num_seqs=1, max_model_len=256)
    split = [output.token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    with norms_unsplit(model):
        unsplit = [output.token_ids for output in LLM(model, max_num_seqs=1, max_model_len=256).generate(
            prompts, params, use_tqdm=False)]
    hf = [reference.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=24, min_new_tokens=24,
                             do_sample=False)[0, len(prompt):].tolist() for prompt in prompts]

    def leading(a, b):  # bf16: the tokens until the first divergence
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))

    assert sum(map(leading, split, hf)) >= 0.75 * 24 * len(prompts)
    assert sum(map(leading, split, unsplit)) >= 0.75 * 24 * len(prompts)
