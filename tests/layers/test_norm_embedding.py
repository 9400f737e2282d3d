"""RMSNorm's variants, LayerNorm and the scaled embedding against HuggingFace's modules, bit for bit."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.cohere import modeling_cohere as hf_cohere
from transformers.models.gemma2 import modeling_gemma2 as hf_gemma2
from transformers.models.llama import modeling_llama as hf_llama
from transformers.models.nemotron import modeling_nemotron as hf_nemotron
from transformers.models.olmo import modeling_olmo as hf_olmo
from transformers.models.olmo2 import modeling_olmo2 as hf_olmo2
from transformers.models.olmo3 import modeling_olmo3 as hf_olmo3
from transformers.models.olmoe import modeling_olmoe as hf_olmoe

from layers import LayerNorm, RMSNorm, VocabEmbedding
from layers.parallel import _split_head_norm

VARIANTS = {  # HF's module -> the options of zoo's RMSNorm that reproduce it
    "llama": (hf_llama.LlamaRMSNorm, {}),
    "gemma2": (hf_gemma2.Gemma2RMSNorm, {"weight_offset": 1.0, "multiply_in_float32": True}),
    "olmo2": (hf_olmo2.Olmo2RMSNorm, {"multiply_in_float32": True}),
    "olmo3": (hf_olmo3.Olmo3RMSNorm, {"multiply_in_float32": True}),
    "olmoe": (hf_olmoe.OlmoeRMSNorm, {}),  # Llama's
}


def assert_norms_alike(norm, reference, dtype, hidden_size: int = 64):
    """``norm(x)`` is ``reference(x)``, and ``norm(x, residual)`` is ``(reference(x + residual), x + residual)``,
    the residual added in the input dtype as HF's blocks add it."""
    x, residual = torch.randn(2, 5, hidden_size, dtype=dtype), torch.randn(2, 5, hidden_size, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(norm(x), reference(x))
        normed, summed = norm(x, residual)
        assert torch.equal(summed, x + residual)
        assert torch.equal(normed, reference(x + residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_rms_norm_variants_equal_hf(variant, dtype):
    hf_class, options = VARIANTS[variant]
    torch.manual_seed(0)
    reference = hf_class(64, eps=1e-6)
    reference.weight.data = torch.randn(64)
    reference.to(dtype)
    norm = RMSNorm(64, 1e-6, **options)
    norm.weight.data = reference.weight.data.clone()
    assert_norms_alike(norm, reference, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_layer_norm_equals_torch(dtype):
    """Starcoder2's and StableLM's norms are torch's LayerNorm, the residual added first."""
    torch.manual_seed(0)
    reference = torch.nn.LayerNorm(64, eps=1e-5)
    with torch.no_grad():
        reference.weight.normal_()
        reference.bias.normal_()
    reference.to(dtype)
    norm = LayerNorm(64, 1e-5)
    norm.weight.data = reference.weight.data.clone()
    norm.bias.data = reference.bias.data.clone()
    assert_norms_alike(norm, reference, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_layer_norm_with_weight_offset_equals_nemotrons(dtype):
    """Nemotron's LayerNorm1P multiplies by ``1 + weight``, the one added in the weight's dtype."""
    torch.manual_seed(0)
    reference = hf_nemotron.NemotronLayerNorm1P(64, eps=1e-5)
    with torch.no_grad():
        reference.weight.normal_()
        reference.bias.normal_()
    reference.to(dtype)
    norm = LayerNorm(64, 1e-5, weight_offset=1.0)
    norm.weight.data = reference.weight.data.clone()
    norm.bias.data = reference.bias.data.clone()
    assert_norms_alike(norm, reference, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_layer_norm_without_weight_equals_olmos(dtype):
    """OLMo's LayerNorm, without weight or bias, normalises a float32 copy and rounds once, as HF's; torch's
    kernel on the input itself sums in an order of its own, and in bfloat16 and float16 an output rounds the
    other way now and then."""
    reference = hf_olmo.OlmoLayerNorm(4096)
    norm = LayerNorm(4096, 1e-5, elementwise_affine=False)
    assert list(norm.parameters()) == []
    assert_norms_alike(norm, reference, dtype, hidden_size=4096)
    torch.manual_seed(0)
    x = torch.randn(64, 4096).to(dtype)
    kernel_on_input = F.layer_norm(x, (4096,), eps=1e-5)
    assert torch.equal(kernel_on_input, norm(x)) == (dtype == torch.float32)


def test_a_weight_offset_holds_in_each_heads_weight_and_its_tensor_parallel_form():
    torch.manual_seed(0)
    norm = LayerNorm((4, 16), 1e-5, bias=False, weight_offset=1.0)
    norm.weight.data = torch.randn(4, 16)
    x = torch.randn(3, 4, 16)
    with torch.no_grad():
        assert torch.equal(norm(x), F.layer_norm(x, (16,)) * (1 + norm.weight))
    with torch.device("meta"):
        held = _split_head_norm(norm, slice(2, 4))
    assert (held.weight.shape, held.weight_offset, held.heads) == ((2, 16), 1.0, slice(2, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [64, (4, 16)], ids=["block", "weight_per_head"])
def test_bias_free_layer_norm_equals_coheres(shape, dtype):
    """Cohere's LayerNorm, of a block or with a weight per head (its q/k norms over [..., heads,
    head_dim]), computed in float32: HF's to float32 rounding in float32 (torch's kernel orders the
    sums its own way), so that in bfloat16 and float16 an output rounds the other way now and then:
    at most one unit of the dtype apart, on a small share of the outputs."""
    torch.manual_seed(0)
    reference = hf_cohere.CohereLayerNorm(shape, eps=1e-5)
    reference.weight.data = torch.randn(shape)
    reference.to(dtype)
    norm = LayerNorm(shape, 1e-5, bias=False)
    norm.weight.data = reference.weight.data.clone()
    x = (torch.randn(2, 5, 64) * 3 + 1).to(dtype).reshape(2, 5, *norm.weight.shape)
    with torch.no_grad():
        ours, theirs = norm(x), reference(x)
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=0, atol=4e-6)
    else:
        unit = torch.finfo(dtype).eps  # one unit in the last place, relative
        torch.testing.assert_close(ours, theirs, rtol=unit, atol=unit)
        assert (ours != theirs).float().mean() <= 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_embedding_scale_is_rounded_to_the_dtype_as_hf_does(dtype):
    torch.manual_seed(0)
    reference = hf_gemma2.Gemma2TextScaledWordEmbedding(97, 3072, padding_idx=0, embed_scale=3072**0.5).to(dtype)
    embedding = VocabEmbedding(97, 3072, scale=3072**0.5)
    embedding.weight.data = reference.weight.data.clone()
    ids = torch.tensor([[3, 1, 96, 40]])
    with torch.no_grad():
        assert torch.equal(embedding(ids), reference(ids))
    if dtype == torch.bfloat16:  # sqrt(3072) = 55.43 is 55.5 in bfloat16
        assert torch.equal(embedding(ids), embedding.weight[ids] * 55.5)
