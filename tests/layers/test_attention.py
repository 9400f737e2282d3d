"""The attention contract: the score modifiers each backend implements, and the fallback; who
writes the KV cache; which q/k norm a clamp of q, k and v may follow, and which norm has a weight per head."""

from functools import partial

import pytest
import torch

import layers.attention
from layers import (Attention, LayerNorm, RMSNorm, ScoreModifiers, TorchAttentionBackend, TritonAttentionBackend,
                    score_modifiers_used)
from layers.attention import BACKENDS, AttentionMetadata, select_backend
from ops_cuda.rotary import apply_rotary_reference
from tests.ops.test_triton_ops import rope_table


def test_a_layer_states_the_modifiers_it_uses():
    plain = Attention(64, 4, 2, 16)
    capped = Attention(64, 4, 2, 16, logit_softcap=50.0)
    assert plain.score_modifiers == ScoreModifiers() and plain.score_modifiers.used == frozenset()
    assert capped.score_modifiers.softcap == 50.0 and capped.score_modifiers.used == {"softcap"}
    assert score_modifiers_used(plain) == frozenset() and score_modifiers_used(capped) == {"softcap"}


def test_every_backend_implements_softcapping():
    assert all("softcap" in backend.score_modifiers for backend in BACKENDS.values())


def test_clip_qkv_follows_a_norm_over_the_whole_projection_only():
    Attention(64, 4, 2, 16, qk_norm_eps=1e-6, qk_norm_per_head=False, clip_qkv=8.0)  # OLMoE's
    Attention(64, 4, 2, 16, clip_qkv=8.0)  # no norm
    with pytest.raises(ValueError, match="clip_qkv after a per-head q/k norm is not implemented"):
        Attention(64, 4, 2, 16, qk_norm_eps=1e-6, clip_qkv=8.0)


def test_a_weight_per_head_is_a_layer_norm_over_each_head():
    bias_free = partial(LayerNorm, bias=False)
    attention = Attention(64, 4, 2, 16, qk_norm_eps=1e-5, qk_norm_weight_per_head=True, qk_norm=bias_free)  # Cohere's
    assert attention.q_norm.weight.shape == (4, 16) and attention.k_norm.weight.shape == (2, 16)
    for options in (dict(qk_norm=RMSNorm), dict(qk_norm=bias_free, qk_norm_per_head=False)):
        with pytest.raises(ValueError, match="a weight of their own per head are LayerNorms over each head"):
            Attention(64, 4, 2, 16, qk_norm_eps=1e-5, qk_norm_weight_per_head=True, **options)


def test_a_backend_lacking_a_modifier_falls_back_to_torch_with_a_warning(monkeypatch):
    monkeypatch.setattr(TritonAttentionBackend, "score_modifiers", frozenset())
    with pytest.warns(UserWarning, match="triton attention backend does not implement .*softcap"):
        backend = select_backend("triton", "cpu", frozenset({"softcap"}))
    assert type(backend) is TorchAttentionBackend
    assert type(select_backend("triton", "cpu")) is TritonAttentionBackend


def paged_prefill(layer: Attention, hidden: torch.Tensor, positions: torch.Tensor, block_size: int = 4):
    """layer's output for two prompts of equal length in ``hidden`` [2 * T, hidden], through a
    fresh paged cache of the layer's dtype; returns the output and the caches."""
    length = hidden.shape[0] // 2
    blocks = -(-length // block_size)
    k_cache, v_cache = torch.full((2, 2 * blocks, block_size, layer.num_kv_heads, layer.head_dim), float("nan"),
                                  dtype=hidden.dtype)
    layer.kv_cache = (k_cache, v_cache)
    block_tables = torch.arange(2 * blocks, dtype=torch.int32).view(2, blocks)
    steps = torch.arange(length)
    slots = (block_tables[:, steps // block_size].long() * block_size + steps % block_size).flatten()
    metadata = AttentionMetadata(
        query_lens=[length] * 2, context_lens=[0, 0], slot_mapping=slots, block_tables=block_tables,
        seq_lens=torch.full((2,), length, dtype=torch.int32),
        query_start_loc=torch.arange(0, 3 * length, length, dtype=torch.int32),
    )
    return layer(hidden, rope_table(positions, layer.head_dim), metadata), k_cache, v_cache


def qk_norm_layer(dtype) -> Attention:
    torch.manual_seed(0)
    layer = Attention(64, 4, 2, 16, qk_norm_eps=1e-6).to(dtype)
    for parameter in layer.parameters():
        parameter.data.normal_(0, 0.3)
    return layer


@pytest.mark.parametrize("backend", [TorchAttentionBackend, TritonAttentionBackend])
def test_a_layer_writes_its_cache_before_the_backend_attends(backend):
    # The layer's one op writes every new token's key, normalised per head and rotated, and its value
    # at the token's slot, and the paged prefill's output is the cache-free prefill's.
    layer = qk_norm_layer(torch.float32)
    layer.backend = backend()
    hidden, positions = torch.randn(10, 64), torch.arange(5).repeat(2)
    paged, k_cache, v_cache = paged_prefill(layer, hidden, positions)
    cache_free = layer(hidden, rope_table(positions, 16), AttentionMetadata.causal_prefill(2, 5))
    torch.testing.assert_close(paged, cache_free, rtol=1e-5, atol=1e-5)
    q, k, v = layer.qkv_proj.split(layer.qkv_proj(hidden))
    k = layer.k_norm(k.reshape(10, 2, 16))
    _, k_rotated = apply_rotary_reference(k, k, *rope_table(positions, 16))
    slots = torch.tensor([0, 1, 2, 3, 4, 8, 9, 10, 11, 12])  # two blocks of 4 per prompt
    assert torch.equal(k_cache.view(-1, 2, 16)[slots], k_rotated)
    assert torch.equal(v_cache.view(-1, 2, 16)[slots], v.reshape(10, 2, 16))
    unwritten = torch.ones(16, dtype=torch.bool)
    unwritten[slots] = False
    assert k_cache.view(-1, 2, 16)[unwritten].isnan().all() and v_cache.view(-1, 2, 16)[unwritten].isnan().all()


@pytest.mark.interpreter
def test_a_layer_with_the_fused_kernel_matches_the_reference_interpreted(monkeypatch):
    # The layer with its fused op as the Triton kernel (strided q/k/v of the qkv product, per-head
    # norm, GQA) gives the reference's output and caches bit for bit in float16.
    from ops_cuda.triton_kernels import rotary_write_kv_triton

    layer = qk_norm_layer(torch.float16)
    hidden, positions = torch.randn(10, 64, dtype=torch.float16), torch.tensor([0, 1, 2, 3, 4, 7, 8, 9, 10, 11])
    expected = paged_prefill(layer, hidden, positions)
    monkeypatch.setattr(layers.attention, "rotary_write_kv", rotary_write_kv_triton)
    for ours, theirs in zip(paged_prefill(layer, hidden, positions), expected):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
