"""The CUDA kernels of ``zoo::moe_experts`` against the op's PyTorch reference: the grouped GEMMs
(``ops_cuda/moe_grouped_mm.py``, bf16 on sm90/sm100), the Triton fused-MoE kernel
(``ops_cuda/moe_triton.py``, fp16 and bf16 here; float32 and the CPU interpreter in
``tests/ops/test_moe_triton.py``) and the decode kernel (``ops_cuda/moe_decode.py``; its interpreter
tests in ``tests/ops/test_moe_decode.py``), each forced through the dispatch's thresholds: uneven expert loads,
experts without tokens, one expert for all, one token, none; Qwen3-30B-A3B layer shapes; GPT-OSS's experts
(biases, the clamped SwiGLU) at gpt-oss-20b's shapes; buffers poisoned with NaN; under CUDA-graph capture
with the routing changed between replays; and a tiny Qwen3-MoE through the runtime giving the same greedy
tokens eagerly and with CUDA graphs. The dispatch itself: which kernel
runs for which dtype, shape and number of pairs.
"""

import random

import pytest
import torch

import ops_cuda.moe
from ops_cuda import moe_experts
from ops_cuda.moe import DECODE_MAX_PAIRS, GROUPED_MM_MIN_PAIRS, cuda_kernel, moe_experts_reference
from ops_cuda.moe_decode import DECODE_MAX_TOKENS
from tests.conftest import poison_allocator
from tests.ops.test_moe_triton import expert_biases

pytestmark = pytest.mark.gpu

# Largest difference allowed, relative to the reference's largest magnitude: the last rounding to bf16 alone
# is up to half a unit in the last place (2^-8 relative); two roundings that differ give one or two units
# at the largest values. The same in fp16, whose unit in the last place is 2^-10 relative (with margin).
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 5e-3}
# (dtype, kernel) pairs the tests force through the dispatch: grouped_mm takes bf16 only.
KERNELS = [(torch.bfloat16, "grouped_mm"), (torch.bfloat16, "triton"), (torch.float16, "triton"),
           (torch.bfloat16, "decode"), (torch.float16, "decode")]
KERNEL_IDS = ["bf16-grouped_mm", "bf16-triton", "fp16-triton", "bf16-decode", "fp16-decode"]


def fast_path_device() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)


def force_kernel(monkeypatch, kernel: str, tokens: int = 1) -> None:
    """Moves the dispatch's thresholds so that ``kernel`` runs whatever the number of pairs (the decode
    kernel: up to DECODE_MAX_TOKENS tokens)."""
    if kernel == "grouped_mm" and not fast_path_device():
        pytest.skip("torch's grouped GEMM kernel needs sm90/sm100")
    if kernel == "decode" and not 0 < tokens <= DECODE_MAX_TOKENS:
        pytest.skip(f"the decode kernel takes 1 to {DECODE_MAX_TOKENS} tokens")
    monkeypatch.setattr(ops_cuda.moe, "GROUPED_MM_MIN_PAIRS", 0 if kernel == "grouped_mm" else 1 << 62)
    monkeypatch.setattr(ops_cuda.moe, "DECODE_MAX_PAIRS", 1 << 62 if kernel == "decode" else 0)


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.float()
    return ((ours.float() - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


def experts(num_experts, hidden_size, intermediate, dtype, seed=0):
    """gate_up [E, 2I, H], down [E, H, I] scaled so every intermediate is of order one."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden_size, device="cuda", generator=g) / hidden_size**0.5
    down = torch.randn(num_experts, hidden_size, intermediate, device="cuda", generator=g) / intermediate**0.5
    return gate_up.to(dtype), down.to(dtype)


def routed(num_tokens, top_k, allowed, seed):
    """topk ids drawn only from ``allowed`` experts (distinct per token), and softmax weights (float32)."""
    rng = random.Random(seed)
    ids = torch.tensor([rng.sample(allowed, top_k) for _ in range(num_tokens)], dtype=torch.int64)
    ids = ids.view(num_tokens, top_k)
    weights = torch.randn(num_tokens, top_k, generator=torch.Generator().manual_seed(seed)).softmax(-1)
    return weights.cuda(), ids.cuda()


def router(num_tokens, num_experts, top_k, seed, skew=2.0):
    """As the model's router picks them: softmax of random logits (some experts favoured), top-k, renormalised."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=g)
    logits += skew * torch.randn(num_experts, device="cuda", generator=g)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def run_poisoned(*args):
    poison_allocator()
    out = moe_experts(*args)
    torch.cuda.synchronize()
    return out


def check(hidden, weights, ids, gate_up, down, activation, kernel, *biases):
    """The op (NaN-poisoned buffers) against the reference in the same dtype and in float32, after
    checking that the dispatch runs ``kernel``; ``biases``: the experts' (gate_up_bias, down_bias), if any."""
    assert cuda_kernel(hidden, ids, gate_up, down, activation, *biases) == kernel
    ours = run_poisoned(hidden, weights, ids, gate_up, down, activation, *biases)
    assert ours.shape == hidden.shape and ours.dtype == hidden.dtype
    if hidden.shape[0] == 0:
        return
    assert not ours.isnan().any(), "NaN in the output: a buffer row read before it was written"
    reference = moe_experts_reference(hidden, weights, ids, gate_up, down, activation, *biases)
    exact = moe_experts_reference(hidden.float(), weights, ids, gate_up.float(), down.float(), activation,
                                  *(bias.float() for bias in biases))
    dtype = hidden.dtype
    error, reference_error = relative_error(ours, reference), relative_error(reference, exact)
    ours_exact = relative_error(ours, exact)
    print(f"{kernel} {dtype} tokens={hidden.shape[0]}: vs reference {error:.1e}, vs float32 {ours_exact:.1e} "
          f"(reference vs float32 {reference_error:.1e})")
    assert error < TOL[dtype] and ours_exact < TOL[dtype]


# ---------------------------------------------------------------------------------------------
# The dispatch
# ---------------------------------------------------------------------------------------------


def test_dispatch_picks_the_kernel():
    """The decode kernel up to DECODE_MAX_PAIRS pairs in fp16/bf16; grouped_mm from GROUPED_MM_MIN_PAIRS pairs
    on, for what it takes (bf16 on sm90/sm100, 16-byte rows); the Triton kernel between them and for what
    neither takes; the reference for mixed dtypes."""
    gate_up, down = experts(8, 64, 32, torch.bfloat16)
    few = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)
    many = torch.randn(GROUPED_MM_MIN_PAIRS, 64, device="cuda", dtype=torch.bfloat16)  # top-1: a pair per token
    few_ids, many_ids = routed(5, 2, list(range(8)), seed=0)[1], routed(len(many), 1, list(range(8)), seed=0)[1]
    large = "grouped_mm" if fast_path_device() else "triton"
    assert cuda_kernel(few, few_ids, gate_up, down, "silu") == "decode"
    assert cuda_kernel(few.half(), few_ids, gate_up.half(), down.half(), "silu") == "decode"
    assert cuda_kernel(few.float(), few_ids, gate_up.float(), down.float(), "silu") == "triton"
    top8 = routed(DECODE_MAX_PAIRS // 8 + 1, 8, list(range(8)), seed=0)[1]
    assert cuda_kernel(many[: DECODE_MAX_PAIRS // 8], top8[:-1], gate_up, down, "silu") == "decode"
    assert cuda_kernel(many[: DECODE_MAX_PAIRS // 8 + 1], top8, gate_up, down, "silu") == "triton"
    assert cuda_kernel(many, many_ids, gate_up, down, "silu") == large
    assert cuda_kernel(many[:-1], many_ids[:-1], gate_up, down, "silu") == "triton"  # one pair short
    for dtype in (torch.float16, torch.float32):
        assert cuda_kernel(many.to(dtype), many_ids, gate_up.to(dtype), down.to(dtype), "silu") == "triton"
    unaligned_up, unaligned_down = experts(8, 64, 36, torch.bfloat16)  # I = 36: rows of 72 bytes
    assert cuda_kernel(many, many_ids, unaligned_up, unaligned_down, "silu") == "triton"
    assert cuda_kernel(many.half(), many_ids, gate_up, down, "silu") == "reference"
    # Biased experts: never grouped_mm (no bias before its rounding); biases of another dtype: the reference.
    biases = expert_biases(8, 64, 32, torch.bfloat16, device="cuda")
    assert cuda_kernel(few, few_ids, gate_up, down, "clamped_swiglu", *biases) == "decode"
    assert cuda_kernel(many, many_ids, gate_up, down, "clamped_swiglu", *biases) == "triton"
    assert cuda_kernel(few, few_ids, gate_up, down, "silu", biases[0].float(), biases[1]) == "reference"


@pytest.mark.skipif(not fast_path_device(), reason="torch's grouped GEMM kernel needs sm90/sm100")
def test_grouped_gemm_path_passes_the_transposed_weights(monkeypatch):
    force_kernel(monkeypatch, "grouped_mm")
    calls = []
    grouped_mm = torch._grouped_mm

    def counting(*args, **kwargs):
        calls.append(args[1].shape)
        return grouped_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    gate_up, down = experts(8, 64, 32, torch.bfloat16)
    weights, ids = routed(5, 2, list(range(8)), seed=0)
    moe_experts(torch.randn(5, 64, device="cuda", dtype=torch.bfloat16), weights, ids, gate_up, down, "silu")
    assert calls == [(8, 64, 64), (8, 32, 64)]  # gate_up^T [E, H, 2I], down^T [E, I, H]


# ---------------------------------------------------------------------------------------------
# Against the reference
# ---------------------------------------------------------------------------------------------

CASES = {
    "uneven": dict(tokens=37, top_k=2, allowed=[0, 2, 3, 6, 7, 11, 15]),  # 9 of 16 experts get no tokens
    "one_expert": dict(tokens=20, top_k=1, allowed=[5]),  # every token on expert 5
    "last_expert_only": dict(tokens=9, top_k=1, allowed=[15]),  # every group but the last empty
    "one_token": dict(tokens=1, top_k=4, allowed=list(range(16))),  # a decode step
    "many_tokens": dict(tokens=700, top_k=4, allowed=list(range(16))),  # groups of ~175 rows: the large tiles
    "no_tokens": dict(tokens=0, top_k=2, allowed=list(range(16))),
}


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype, kernel", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case, dtype, kernel, activation, monkeypatch):
    spec = CASES[case]
    force_kernel(monkeypatch, kernel, spec["tokens"])
    gate_up, down = experts(16, 256, 128, dtype)
    hidden = torch.randn(spec["tokens"], 256, device="cuda").to(dtype)
    weights, ids = routed(spec["tokens"], spec["top_k"], spec["allowed"], seed=1)
    check(hidden, weights, ids, gate_up, down, activation, kernel)


@pytest.mark.parametrize("dtype, kernel", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("tokens", [1, 16, 64, 300, 4096])
def test_qwen3_30b_a3b_layer_shape(tokens, dtype, kernel, monkeypatch):
    """128 experts of 2048 -> 768 -> 2048, top-8 (one layer of Qwen3-30B-A3B): decode steps (most experts
    empty or with one row; the Triton kernel's 16-row blocks up to 256 tokens) and prefill chunks (its
    64-row blocks; ~256 rows per expert at 4096 tokens)."""
    force_kernel(monkeypatch, kernel, tokens)
    gate_up, down = experts(128, 2048, 768, dtype)
    hidden = torch.randn(tokens, 2048, device="cuda", dtype=dtype)
    weights, ids = router(tokens, 128, 8, seed=tokens)
    check(hidden, weights, ids, gate_up, down, "silu", kernel)


@pytest.mark.parametrize("dtype, kernel", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("tokens", [1, 300, 4096])
@pytest.mark.parametrize("held", [range(0, 64), range(96, 128)], ids=["first_half", "last_quarter"])
def test_ids_of_experts_on_other_ranks_are_skipped(held, tokens, dtype, kernel, monkeypatch):
    """Expert parallelism: a rank holding the experts ``held`` of Qwen3-30B-A3B's routing (128 experts,
    top-8; those of rank 0 of 2 and of rank 3 of 4) gets the other ids as -1. Those pairs get no row
    (NaN-poisoned buffers would show one read) and add nothing: the output is the whole model's with
    their weights zeroed. With no held expert picked, the output is zero."""
    if kernel == "decode" and tokens > DECODE_MAX_TOKENS:
        pytest.skip(f"the decode kernel takes at most {DECODE_MAX_TOKENS} tokens")
    force_kernel(monkeypatch, kernel)
    gate_up, down = experts(128, 256, 128, dtype)
    hidden = torch.randn(tokens, 256, device="cuda", dtype=dtype)
    weights, ids = router(tokens, 128, 8, seed=tokens)
    mine = (ids >= held.start) & (ids < held.stop)
    local_ids = torch.where(mine, ids - held.start, -1)
    local_gate_up, local_down = gate_up[held.start : held.stop], down[held.start : held.stop]
    check(hidden, weights, local_ids, local_gate_up, local_down, "silu", kernel)
    ours = run_poisoned(hidden, weights, local_ids, local_gate_up, local_down, "silu")
    whole = moe_experts_reference(hidden, weights.masked_fill(~mine, 0.0), ids, gate_up, down, "silu")
    assert relative_error(ours, whole) < TOL[dtype]
    none_picked = run_poisoned(hidden, weights, torch.full_like(ids, -1), local_gate_up, local_down, "silu")
    assert torch.equal(none_picked, torch.zeros_like(hidden))


@pytest.mark.parametrize("dtype, kernel", KERNELS, ids=KERNEL_IDS)
def test_int32_ids_and_strided_hidden(dtype, kernel, monkeypatch):
    force_kernel(monkeypatch, kernel)
    gate_up, down = experts(16, 256, 128, dtype)
    rows = torch.randn(40, 512, device="cuda", dtype=dtype)
    weights, ids = router(40, 16, 4, seed=3)
    check(rows[:, :256], weights, ids.int(), gate_up, down, "silu", kernel)  # a strided view, int32 ids


def test_unaligned_shapes_run_the_triton_kernel():
    gate_up, down = experts(16, 256, 36, torch.bfloat16)  # I = 36: not 16-byte rows, grouped_mm cannot
    weights, ids = router(40, 16, 4, seed=3)
    check(torch.randn(40, 256, device="cuda", dtype=torch.bfloat16), weights, ids, gate_up, down, "silu", "triton")


@pytest.mark.parametrize("dtype, kernel", KERNELS, ids=KERNEL_IDS)
def test_fake_kernel_matches_cuda_kernel(dtype, kernel, monkeypatch):
    force_kernel(monkeypatch, kernel)
    gate_up, down = experts(16, 256, 128, dtype)
    weights, ids = routed(9, 2, [0, 1, 3], seed=2)
    args = (torch.randn(9, 256, device="cuda", dtype=dtype), weights, ids, gate_up, down, "silu")
    torch.library.opcheck(torch.ops.zoo.moe_experts.default, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_decode_kernel_skips_experts_of_other_ranks(tokens, dtype):
    """Ids of -1 (experts on another rank under expert parallelism) add nothing: the reference on the other
    pairs, a token whose experts are all elsewhere gives zeros. Qwen3-30B-A3B expert shapes, 32 experts."""
    gate_up, down = experts(32, 2048, 768, dtype)
    hidden = torch.randn(tokens, 2048, device="cuda", dtype=dtype)
    weights, ids = router(tokens, 32, 8, seed=tokens)
    ids[:, 1::3] = -1
    ids[0] = -1
    assert cuda_kernel(hidden, ids, gate_up, down, "silu") == "decode"
    ours = run_poisoned(hidden, weights, ids, gate_up, down, "silu")
    missing = ids < 0
    reference = moe_experts_reference(hidden, weights.masked_fill(missing, 0.0), ids.masked_fill(missing, 0), gate_up,
                                      down, "silu")
    assert not ours.isnan().any()
    assert torch.equal(ours[0], torch.zeros_like(ours[0]))
    if tokens > 1:
        assert relative_error(ours, reference) < TOL[dtype]


@pytest.mark.parametrize("missing", [False, True], ids=["", "missing"])
@pytest.mark.parametrize("tokens, kernel", [(1, "decode"), (4, "decode"), (300, "triton"),
                                            (GROUPED_MM_MIN_PAIRS // 4, "triton")])
def test_gpt_oss_experts(tokens, kernel, missing):
    """GPT-OSS's experts, bf16: biases and the clamped SwiGLU, gpt-oss-20b's shapes (32 experts of
    2880 -> 2880 -> 2880, top-4), the hidden states scaled so that gate and up pass the clamps at ±7.
    Decode steps, a fused-MoE batch, and GROUPED_MM_MIN_PAIRS pairs, which biased experts run in the Triton
    kernel. ``missing``: every other slot's id -1 (an expert on another rank), which adds nothing, nor its biases."""
    gate_up, down = experts(32, 2880, 2880, torch.bfloat16)
    biases = expert_biases(32, 2880, 2880, torch.bfloat16, device="cuda")
    hidden = (torch.randn(tokens, 2880, device="cuda") * 5).to(torch.bfloat16)
    weights, ids = router(tokens, 32, 4, seed=tokens)
    if not missing:
        check(hidden, weights, ids, gate_up, down, "clamped_swiglu", kernel, *biases)
        return
    local_ids = ids.clone()
    local_ids[:, 1::2] = -1
    assert cuda_kernel(hidden, local_ids, gate_up, down, "clamped_swiglu", *biases) == kernel
    ours = run_poisoned(hidden, weights, local_ids, gate_up, down, "clamped_swiglu", *biases)
    reference = moe_experts_reference(hidden, weights.masked_fill(local_ids < 0, 0.0), ids, gate_up, down,
                                      "clamped_swiglu", *biases)
    assert not ours.isnan().any()
    assert relative_error(ours, reference) < TOL[torch.bfloat16]


@pytest.mark.parametrize("tokens", [1, 8])
def test_decode_kernel_deepseek_v3_expert_shape(tokens):
    """DeepSeek-V3's expert shape (7168 -> 2048 -> 7168, top-8; 16 experts here rather than 256)."""
    gate_up, down = experts(16, 7168, 2048, torch.bfloat16)
    weights, ids = router(tokens, 16, 8, seed=tokens)
    check(torch.randn(tokens, 7168, device="cuda", dtype=torch.bfloat16), weights * 2.5, ids, gate_up, down, "silu",
          "decode")


# ---------------------------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, kernel", KERNELS, ids=KERNEL_IDS)
def test_captured_graph_follows_the_routing(dtype, kernel, monkeypatch):
    """Captured once; the hidden states and the routing rewritten in place before each replay (uneven, all
    on a few experts, one expert per token): every replay is bit-identical to the eager op on the same
    inputs, and a replay repeated gives the same output."""
    force_kernel(monkeypatch, kernel)
    num_tokens, top_k = 48, 4
    gate_up, down = experts(16, 256, 128, dtype)
    hidden = torch.randn(num_tokens, 256, device="cuda").to(dtype)
    weights, ids = router(num_tokens, 16, top_k, seed=0)
    args = (hidden, weights, ids, gate_up, down, "silu")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and load the kernels outside the capture
        moe_experts(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(*args)

    routings = [
        router(num_tokens, 16, top_k, seed=1),
        routed(num_tokens, top_k, [1, 4, 9, 12, 13], seed=2),  # 11 experts empty
        routed(num_tokens, top_k, [2, 3, 5, 7], seed=3),  # every token on the same 4 experts
        router(num_tokens, 16, top_k, seed=4, skew=8.0),
    ]
    for step, (new_weights, new_ids) in enumerate(routings):
        hidden.copy_(torch.randn(num_tokens, 256, device="cuda").to(dtype))
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        out.fill_(float("nan"))
        graph.replay()
        replayed = out.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out), f"routing {step}: two replays differ"
        eager = moe_experts(*args)
        assert not replayed.isnan().any()
        error = relative_error(replayed, eager)
        assert torch.equal(replayed, eager), f"routing {step}: replay differs from eager by {error:.1e}"


# ---------------------------------------------------------------------------------------------
# A model through the runtime
# ---------------------------------------------------------------------------------------------


def test_runtime_qwen3_moe_cuda_graphs_give_the_eager_tokens():
    import transformers

    from models import AutoModelForCausalLM
    from tests.conftest import tiny_config
    from tests.runtime.test_gpu_runtime import assert_graphs_give_the_eager_tokens

    config = tiny_config(
        "qwen3_moe", vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=256, norm_topk_prob=True, max_position_embeddings=2048, initializer_range=0.02,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model = AutoModelForCausalLM.from_hf(reference)
    del reference
    assert_graphs_give_the_eager_tokens(model)
