"""zoo's op references and rotary tables against HuggingFace's own functions."""

import copy
import pickle
import types

import pytest
import torch
import transformers
from transformers.activations import ACT2FN
from transformers.models.cohere import modeling_cohere as hf_cohere
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek_v3
from transformers.models.ernie4_5 import modeling_ernie4_5 as hf_ernie4_5
from transformers.models.gemma3 import modeling_gemma3 as hf_gemma3
from transformers.models.glm import modeling_glm as hf_glm
from transformers.models.gpt_neox import modeling_gpt_neox as hf_gpt_neox
from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss
from transformers.models.llama import modeling_llama as hf_llama
from transformers.models.olmo2 import modeling_olmo2 as hf_olmo2
from transformers.models.olmo3 import modeling_olmo3 as hf_olmo3
from transformers.models.phi3 import modeling_phi3 as hf_phi3

from layers import RotaryEmbedding, rope_layer_types
from ops_cuda import ACTIVATIONS, act_and_mul, apply_rotary, fused_add_rms_norm, rms_norm
from ops_cuda.dispatch import cuda_implementation, public_op
from ops_cuda.linear import PackedWeight, linear
from tests.models.test_parity import VARIANTS


def test_rms_norm_matches_hf():
    torch.manual_seed(0)
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    norm = hf_llama.LlamaRMSNorm(64, eps=1e-6)
    norm.weight.data = torch.randn(64)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, norm.weight, 1e-6), norm(x))
        out, summed = fused_add_rms_norm(x, residual, norm.weight, 1e-6)
        assert torch.equal(summed, x + residual)
        assert torch.equal(out, norm(x + residual))


def packed_weight(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, PackedWeight]:
    """A [96, 64] weight of ``dtype``, a bias, and the weight's pack (the test skipped where this CPU's
    torch packs none)."""
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype)
    if not PackedWeight.supports(weight):
        pytest.skip(f"this CPU's torch packs no {dtype} weights")
    return weight, bias, PackedWeight(weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_weight_serves_the_rows_and_only_the_weight_it_copied(dtype):
    weight, bias, packed = packed_weight(dtype)
    calls, packed_linear = [], packed.linear
    packed.linear = lambda *args: calls.append(args[0].shape) or packed_linear(*args)
    served = [(3, 64), (7, 64), (16, 64), (2, 8, 64), (40, 64)] + ([(1, 64), (0, 64)] if dtype == torch.bfloat16 else [])
    for shape in served:
        x = torch.randn(shape, dtype=dtype)
        assert packed.serves(x) and packed.stands_for(weight)
        out = linear(x, weight, bias, packed)
        assert out.shape == (*shape[:-1], 96) and out.dtype == dtype
        reference = torch.nn.functional.linear(x, weight, bias)
        if dtype == torch.bfloat16:  # oneDNN computes both: the same bits
            assert torch.equal(out, reference)
        else:
            torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-5)
    assert calls == served  # every product above took the pack
    calls.clear()
    # One or two float32 rows (W x^T is faster), a changed weight: not through the pack.
    for x in [torch.randn(2, 64), torch.randn(1, 64)] if dtype == torch.float32 else []:
        assert not packed.serves(x)
        linear(x, weight, bias, packed)
    weight.mul_(2)  # changed in place: the pack no longer stands for it
    x = torch.randn(4, 64, dtype=dtype)
    assert packed.serves(x) and not packed.stands_for(weight)
    torch.testing.assert_close(linear(x, weight, bias, packed), torch.nn.functional.linear(x, weight, bias))
    assert calls == []
    assert copy.deepcopy([packed]) == [None] and pickle.loads(pickle.dumps(packed)) is None  # copies leave it behind


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_compiled_graph_multiplies_by_the_pack_through_zoo_packed_linear(dtype, monkeypatch):
    weight, bias, packed = packed_weight(dtype)
    calls, packed_linear = [], PackedWeight.linear
    monkeypatch.setattr(PackedWeight, "linear", lambda self, x, b: calls.append(x.shape) or packed_linear(self, x, b))
    compiled = torch.compile(lambda x: linear(x, weight, bias, packed), fullgraph=True, backend="aot_eager")
    x = torch.randn(16, 64, dtype=dtype)
    assert torch.equal(compiled(x), packed_linear(packed, x, bias))
    assert calls == [(16, 64)]  # the graph's product, run by the op
    weight.mul_(2)  # changed in place: the op multiplies by the weight itself, as eager steps do
    torch.testing.assert_close(compiled(x), torch.nn.functional.linear(x, weight, bias))
    assert calls == [(16, 64)]
    # The op finds a pack by its number while the pack lives.
    assert PackedWeight.by_number[packed.number] is packed
    other = PackedWeight(weight)
    number = other.number
    del other
    assert number not in PackedWeight.by_number


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="needs MKL")
def test_float32_cpu_products_of_up_to_16_rows_multiply_as_w_x_transposed(monkeypatch):
    import ops_cuda.linear

    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    calls, transposed = [], ops_cuda.linear.transposed_linear
    monkeypatch.setattr(ops_cuda.linear, "transposed_linear", lambda x, *args: calls.append(x.shape) or transposed(x, *args))
    shapes = [(1, 64), (7, 64), (12, 64), (16, 64), (2, 6, 64), (0, 64)]  # 1 and 9-15 rows run padded
    for shape in shapes:
        x = torch.randn(shape)
        for b in (bias, None):
            out = linear(x, weight, b)
            assert out.shape == (*shape[:-1], 96) and out.is_contiguous()
            # (W x^T)^T sums in another order than F.linear
            torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b), rtol=1e-6, atol=1e-5)
    assert calls == [s for s in shapes for _ in range(2)]
    more_rows = torch.randn(17, 64)
    assert torch.equal(linear(more_rows, weight, bias), torch.nn.functional.linear(more_rows, weight, bias))
    assert len(calls) == 2 * len(shapes)  # 17 rows took F.linear


def test_a_compiled_graph_leaves_unpacked_products_to_inductor_for_any_row_count(monkeypatch):
    # W x^T takes up to 16 rows: in a graph with a dynamic row count its bound would tie the graph
    # to 16 rows, and a larger batch would compile it again.
    import ops_cuda.linear

    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    calls, transposed = [], ops_cuda.linear.transposed_linear
    monkeypatch.setattr(ops_cuda.linear, "transposed_linear", lambda x, *args: calls.append(x.shape) or transposed(x, *args))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = torch.compile(lambda x: linear(x, weight, bias), fullgraph=True, backend="aot_eager")
    for rows in (4, 32, 9):
        x = torch.randn(rows, 64)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), torch.nn.functional.linear(x, weight, bias))
    assert calls == []
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_act_and_mul_matches_hf(activation):
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    assert torch.equal(act_and_mul(x, activation), ACT2FN[activation](x[:, :16]) * x[:, 16:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_clamped_swiglu_matches_hf_gpt_oss(dtype):
    """GPT-OSS's gated form, bit for bit, with the default swiglu_alpha and swiglu_limit of its config;
    HF reads gate and up interleaved, zoo's layout has the gate half then the up half."""
    torch.manual_seed(0)
    x = (torch.randn(6, 64) * 5).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    assert (gate > 7).any() and (up > 7).any() and (up < -7).any()  # every clamp bites
    config = transformers.GptOssConfig(num_local_experts=1, hidden_size=4, intermediate_size=32)
    theirs = hf_gpt_oss.GptOssExperts(config)._apply_gate(torch.stack((gate, up), dim=-1).flatten(-2))
    assert torch.equal(act_and_mul(x, "clamped_swiglu"), theirs)


def test_apply_rotary_matches_hf():
    torch.manual_seed(0)
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    cos, sin = torch.randn(7, 16), torch.randn(7, 16)
    ours = apply_rotary(q, k, cos, sin)
    theirs = hf_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_apply_rotary_rounds_as_hf_llama_or_as_hf_olmo(dtype):
    """Llama's rotary embedding rounds float32 cos and sin to the activations' dtype, and each product;
    OLMo 2's and OLMo 3's keep them in float32 and round once (``rotate_in_float32``): each bit for bit."""
    torch.manual_seed(0)
    q, k = torch.randn(7, 4, 16).to(dtype), torch.randn(7, 2, 16).to(dtype)
    cos, sin = rope_table(torch.arange(7) * 37, 16)
    llama = hf_llama.apply_rotary_pos_emb(q, k, cos.to(dtype), sin.to(dtype), unsqueeze_dim=1)
    ours = apply_rotary(q, k, cos, sin)
    assert torch.equal(ours[0], llama[0]) and torch.equal(ours[1], llama[1])
    ours = apply_rotary(q, k, cos, sin, rotate_in_float32=True)
    for hf_olmo in (hf_olmo2, hf_olmo3):
        theirs = hf_olmo.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert not torch.equal(ours[0], llama[0])


def rope_table(positions: torch.Tensor, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    # cos/sin of cat(freqs, freqs), the layout of layers.RotaryEmbedding and of HF's rotary embeddings
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    emb = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)
    return emb.cos(), emb.sin()


def test_apply_rotary_partial_matches_hf():
    # GPT-NeoX's function: the first cos.shape[-1] channels rotate, the rest pass through.
    torch.manual_seed(0)
    q, k = torch.randn(7, 4, 24), torch.randn(7, 2, 24)
    cos, sin = rope_table(torch.arange(7) * 5, 8)
    ours = apply_rotary(q, k, cos, sin)
    theirs = hf_gpt_neox.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_apply_rotary_interleaved_matches_hf():
    torch.manual_seed(0)
    q, k = torch.randn(7, 4, 16), torch.randn(7, 1, 16)
    cos, sin = rope_table(torch.arange(7) * 5, 16)
    ours = apply_rotary(q, k, cos, sin, interleaved=True)
    theirs = hf_deepseek_v3.apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=1)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_apply_rotary_interleaved_partial_matches_hf():
    # DeepSeek's interleaved rotation on the first rotary_dim channels, the rest passed through.
    torch.manual_seed(0)
    q, k = torch.randn(7, 4, 24), torch.randn(7, 2, 24)
    cos, sin = rope_table(torch.arange(7) * 5, 16)
    ours = apply_rotary(q, k, cos, sin, interleaved=True)
    rotated = hf_deepseek_v3.apply_rotary_pos_emb_interleave(q[..., :16], k[..., :16], cos, sin, unsqueeze_dim=1)
    assert torch.equal(ours[0], torch.cat([rotated[0], q[..., 16:]], -1))
    assert torch.equal(ours[1], torch.cat([rotated[1], k[..., 16:]], -1))


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_apply_rotary_of_zero_channels_passes_every_channel(interleaved):
    # A NoPE layer (SmolLM3's) hands the op zero-width cos/sin: q and k as they came, as HF's skipped rotary.
    torch.manual_seed(0)
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    cos, sin = rope_table(torch.arange(7) * 5, 16)
    ours = apply_rotary(q, k, cos[:, :0], sin[:, :0], interleaved=interleaved)
    assert torch.equal(ours[0], q) and torch.equal(ours[1], k)


def test_apply_rotary_interleaved_scores_match_glm():
    # GLM rotates the same pairs but writes them back in place: the channels differ by a fixed
    # permutation, the attention scores q.k do not.
    torch.manual_seed(0)
    q, k = torch.randn(7, 4, 24), torch.randn(7, 2, 24)
    cos, sin = rope_table(torch.arange(7) * 5, 16)
    ours = apply_rotary(q, k, cos, sin, interleaved=True)
    theirs = hf_glm.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)

    def scores(q, k):
        return torch.einsum("nhd,mgd->nmhg", q, k)

    torch.testing.assert_close(scores(*ours), scores(*theirs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_apply_rotary_interleaved_in_float32_matches_cohere(dtype):
    # Cohere rotates the pairs (2i, 2i+1) in float32, from q, k and tables in the activations' dtype,
    # and writes them back in place: its channels, de-interleaved, are ours bit for bit, the tables
    # handed over as the activations' dtype holds them (Attention's rotary_precision "float32").
    torch.manual_seed(0)
    q, k = (torch.randn(7, 4, 16) * 3).to(dtype), (torch.randn(7, 2, 16) * 3).to(dtype)
    cos, sin = rope_table(torch.arange(7) * 5, 16)
    rounded_cos, rounded_sin = cos.to(dtype).float(), sin.to(dtype).float()
    ours = apply_rotary(q, k, rounded_cos, rounded_sin, interleaved=True, rotate_in_float32=True)
    # HF's table of the same angles: each pair's angle twice in a row, cast to the dtype by its rotary embedding
    hf_cos, hf_sin = (t[:, :8].repeat_interleave(2, dim=-1).to(dtype) for t in (cos, sin))
    theirs = hf_cohere.apply_rotary_pos_emb(q, k, hf_cos, hf_sin, unsqueeze_dim=1)
    for mine, hf in zip(ours, theirs):
        assert torch.equal(mine, torch.cat((hf[..., 0::2], hf[..., 1::2]), dim=-1))
    if dtype != torch.float32:  # rounded after each product, as Llama's, it is not Cohere's
        in_dtype = apply_rotary(q, k, cos, sin, interleaved=True)
        assert not torch.equal(in_dtype[0], ours[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_apply_rotary_interleaved_in_float32_matches_ernie(dtype):
    # ERNIE 4.5 rotates the pairs (2i, 2i+1) in float32 by float32 tables and writes them back in place:
    # its channels, de-interleaved, are ours bit for bit (Attention's rotary_precision "float32_tables").
    torch.manual_seed(0)
    q, k = (torch.randn(7, 4, 16) * 3).to(dtype), (torch.randn(7, 2, 16) * 3).to(dtype)
    cos, sin = rope_table(torch.arange(7) * 5, 16)
    ours = apply_rotary(q, k, cos, sin, interleaved=True, rotate_in_float32=True)
    theirs = hf_ernie4_5.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    for mine, hf in zip(ours, theirs):
        assert torch.equal(mine, torch.cat((hf[..., 0::2], hf[..., 1::2]), dim=-1))
    if dtype != torch.float32:  # the tables rounded to the dtype first, as Cohere's, it is not ERNIE's
        rounded = apply_rotary(q, k, cos.to(dtype).float(), sin.to(dtype).float(), interleaved=True,
                               rotate_in_float32=True)
        assert not torch.equal(rounded[0], ours[0])


def test_apply_rotary_rejects_bad_tables():
    q, k = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match="rotary_dim 18 must be even and at most head_dim"):
        apply_rotary(q, k, torch.randn(3, 18), torch.randn(3, 18))
    with pytest.raises(ValueError, match=r"cos/sin \[N, rotary_dim\]"):
        apply_rotary(q, k, torch.randn(1, 16), torch.randn(1, 16))


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.startswith("rope-")] + ["llama-gqa"])
def test_rotary_tables_equal_hf(variant):
    config = VARIANTS[variant]
    positions = torch.arange(40)
    ours = RotaryEmbedding(config, config.hidden_size // config.num_attention_heads)(positions)
    rotary = hf_llama.LlamaRotaryEmbedding(config)
    theirs = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    assert torch.equal(ours[0], theirs[0][0]) and torch.equal(ours[1], theirs[1][0])


def test_rotary_tables_of_each_layer_type_equal_hf():
    config = VARIANTS["gemma3-linear-mqa-tied-capped"]  # the full layers' rope linearly scaled
    hf_rotary = hf_gemma3.Gemma3RotaryEmbedding(config)
    positions = torch.arange(40)
    assert rope_layer_types(config) == ["full_attention", "sliding_attention"]
    for kind in ("full_attention", "sliding_attention"):
        ours = RotaryEmbedding(config, 16, layer_type=kind)(positions)
        theirs = hf_rotary(torch.zeros(1, dtype=torch.float32), positions[None], kind)
        assert torch.equal(ours[0], theirs[0][0]) and torch.equal(ours[1], theirs[1][0])
    assert rope_layer_types(VARIANTS["qwen2-window-layers"]) is None  # layer types, one rope


def test_longrope_tables_equal_hf_and_keep_the_set_they_are_fixed_to():
    config = VARIANTS["phi3-longrope"]  # original context 32; 12 of each head's 16 channels rotate
    hf_rotary = hf_phi3.Phi3RotaryEmbedding(config)

    def hf_tables(length):  # HF picks the set by the forward's longest position
        cos, sin = hf_rotary(torch.zeros(1, dtype=torch.float32), torch.arange(length)[None])
        return cos[0], sin[0]

    ours = RotaryEmbedding(config, 16, partial=True)
    for length in (30, 32, 33, 40):  # per forward, as HF picks: short up to 32 positions
        assert ours.reads_positions_on_host
        assert all(torch.equal(a, b) for a, b in zip(ours(torch.arange(length)), hf_tables(length)))
    long, short = hf_tables(40), hf_tables(30)
    assert not torch.allclose(long[0][:30], short[0], atol=0.1)
    ours.fix_context(33)  # forwards through the cache take the fixed set; cache-free ones still pick
    assert not ours.reads_positions_on_host
    assert all(torch.equal(a, b[:30]) for a, b in zip(ours(torch.arange(30), through_cache=True), long))
    assert all(torch.equal(a, b) for a, b in zip(ours(torch.arange(30)), short))
    ours.fix_context(32)
    assert all(torch.equal(a[:30], b) for a, b in zip(ours(torch.arange(40), through_cache=True), short))
    assert all(torch.equal(a, b) for a, b in zip(ours(torch.arange(40)), long))


def test_longrope_factors_of_the_wrong_count_are_named():
    config = copy.deepcopy(VARIANTS["phi3-longrope"])
    config.rope_parameters["short_factor"] = [1.0] * 8
    with pytest.raises(ValueError, match=r"rope_parameters.short_factor must be 6 finite positive numbers \(one per "
                                         r"rotated channel pair of 12\), got \[1.0"):
        RotaryEmbedding(config, 16, partial=True)


def test_unsupported_rope_type_is_named():
    config = transformers.LlamaConfig(rope_parameters={"rope_type": "proportional", "rope_theta": 1e4,
                                                       "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="unsupported rope_type 'proportional'"):
        RotaryEmbedding(config, 128)


def test_public_names_call_the_reference_on_cpu_the_cuda_kernel_on_cuda_and_the_op_while_tracing(monkeypatch):
    ran = []

    class AddOneOp:  # as much of a torch.library custom op as public_op and cuda_implementation use
        def __call__(self, x):
            ran.append("op")
            return x + 1

        def register_kernel(self, device_type):
            assert device_type == "cuda"
            return lambda kernel: kernel

    add_one_op = AddOneOp()

    @cuda_implementation(add_one_op)
    def _(x):
        ran.append("cuda kernel")
        return x

    def add_one_reference(x):
        """x + 1"""
        ran.append("reference")
        return x + 1

    add_one = public_op(add_one_op, add_one_reference)
    reads_host = public_op(add_one_op, add_one_reference, reads_host=True)
    on_cuda = types.SimpleNamespace(device=torch.device("cuda"))  # all the wrapper reads of a CUDA tensor
    assert add_one.__name__ == "add_one" and add_one.__doc__ == "x + 1"
    assert add_one(torch.zeros(2)).tolist() == [1.0, 1.0]
    assert add_one(torch.zeros(2, device="meta")).device.type == "meta"
    assert add_one(on_cuda) is on_cuda
    assert ran == ["reference", "op", "cuda kernel"]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # as in a graph torch.compile traces
    ran.clear()
    add_one(torch.zeros(2))
    reads_host(torch.zeros(2))
    with pytest.raises(TypeError):  # the op itself, which adds one to what is no tensor
        add_one(on_cuda)
    assert ran == ["reference", "op", "op"]  # an op that reads the host stays opaque to the compiler
    # The package's names: the registered op on meta tensors (its fake kernel).
    x, weight = torch.randn(3, 8), torch.randn(8)
    assert rms_norm(x.to("meta"), weight.to("meta"), 1e-6).shape == (3, 8)


def test_ops_are_registered_custom_ops():
    for name in ("rms_norm", "fused_add_rms_norm", "act_and_mul", "apply_rotary", "write_kv_cache", "rotary_write_kv", "gemv",
                 "gated_gemv", "argmax", "route_topk"):
        assert hasattr(torch.ops.zoo, name)


def fake_kernel_cases():
    # The registered ops themselves: the public names run the references on CPU tensors.
    zoo = torch.ops.zoo
    x, weight = torch.randn(5, 72, dtype=torch.float16), torch.randn(72)
    q = torch.randn(5, 8 * 24)[:, : 4 * 24].view(5, 4, 24)  # a strided view, as from a qkv split
    k = torch.randn(5, 2, 24)
    cos, sin = rope_table(torch.arange(5), 16)
    caches, slots = torch.zeros(2, 2, 4, 2, 24), torch.tensor([0, 3, -1, 7, 5])
    return {
        "rms_norm": (zoo.rms_norm, (x, weight, 1e-6)),
        "rms_norm_heads": (zoo.rms_norm, (q, torch.randn(24), 1e-6)),
        "fused_add_rms_norm": (zoo.fused_add_rms_norm, (x, x.clone(), weight, 1e-6)),
        "rms_norm_gemma": (zoo.rms_norm, (x, weight, 1e-6, 1.0, True)),  # float16 out: multiplied in float32
        "fused_add_rms_norm_gemma": (zoo.fused_add_rms_norm, (x, x.clone(), weight, 1e-6, 1.0, True)),
        "act_and_mul": (zoo.act_and_mul, (x, "silu")),
        "apply_rotary": (zoo.apply_rotary, (q, k, cos, sin)),
        "apply_rotary_interleaved": (zoo.apply_rotary, (q, k, cos, sin, True)),
        "write_kv_cache": (zoo.write_kv_cache, (k, k.clone(), caches[0], caches[1], slots)),
        "rotary_write_kv": (zoo.rotary_write_kv, (q, k, k.clone(), cos, sin, caches[0], caches[1], slots)),
        "rotary_write_kv_qk_norm": (zoo.rotary_write_kv, (q, k, k.clone(), cos, sin, caches[0], caches[1], slots, 1.0,
                                                          1.0, False, torch.randn(24), torch.randn(24), 1e-6)),
        "gemv": (zoo.gemv, (x[:1], torch.randn(7, 72, dtype=torch.float16), None)),
        "argmax": (zoo.argmax, (x,)),
        "gemv_bias": (zoo.gemv, (x[:1], torch.randn(7, 72, dtype=torch.float16), torch.randn(7, dtype=torch.float16))),
        "gated_gemv": (zoo.gated_gemv, (x[:1], torch.randn(14, 72, dtype=torch.float16), None, "silu")),
        "gated_gemv_bias": (zoo.gated_gemv, (x[:1], torch.randn(14, 72, dtype=torch.float16),
                                             torch.randn(14, dtype=torch.float16), "gelu_pytorch_tanh")),
        "route_topk": (zoo.route_topk, (x[:, :16], None, 4, "softmax", True, 1, 1, "top2_sum", 1.0)),
        "route_topk_groups": (zoo.route_topk, (x[:, :16].float(), torch.randn(16), 3, "sigmoid", True, 4, 2,
                                               "top2_sum", 2.5)),
    }


@pytest.mark.parametrize("case", list(fake_kernel_cases()))
def test_fake_kernels_match_references(case):
    # torch.compile traces with the fake kernels: they must give the references' shapes, dtypes and strides.
    op, args = fake_kernel_cases()[case]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
