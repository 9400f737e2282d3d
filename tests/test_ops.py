"""zoo's op references and rotary tables against HuggingFace's own functions."""

import pytest
import torch
import transformers
from transformers.activations import ACT2FN
from transformers.models.llama import modeling_llama as hf_llama

from layers import RotaryEmbedding
from ops_cuda import ACTIVATIONS, act_and_mul, apply_rotary, fused_add_rms_norm, rms_norm
from tests.test_parity import VARIANTS


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


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_act_and_mul_matches_hf(activation):
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    assert torch.equal(act_and_mul(x, activation), ACT2FN[activation](x[:, :16]) * x[:, 16:])


def test_apply_rotary_matches_hf():
    torch.manual_seed(0)
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    cos, sin = torch.randn(7, 16), torch.randn(7, 16)
    ours = apply_rotary(q, k, cos, sin)
    theirs = hf_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.startswith("rope-")] + ["llama-gqa"])
def test_rotary_tables_equal_hf(variant):
    config = VARIANTS[variant]
    positions = torch.arange(40)
    ours = RotaryEmbedding(config, config.hidden_size // config.num_attention_heads)(positions)
    rotary = hf_llama.LlamaRotaryEmbedding(config)
    theirs = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    assert torch.equal(ours[0], theirs[0][0]) and torch.equal(ours[1], theirs[1][0])


def test_unsupported_rope_type_is_named():
    config = transformers.LlamaConfig(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                       "short_factor": [1.0] * 64, "long_factor": [1.0] * 64})
    with pytest.raises(ValueError, match="unsupported rope_type 'longrope'"):
        RotaryEmbedding(config, 128)


def test_ops_are_registered_custom_ops():
    for name in ("rms_norm", "fused_add_rms_norm", "act_and_mul", "apply_rotary"):
        assert hasattr(torch.ops.zoo, name)
