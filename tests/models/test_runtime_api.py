"""What a model offers the runtime (``CausalLM`` in models/base.py): the KV cache it needs, binding
one with an attention backend, and whether its forward can be captured."""

import pytest
import torch

from layers.attention import select_backend
from models import model_class_for
from tests.conftest import tiny_config


def build(config):
    return model_class_for(config)(config)


def test_kv_cache_spec_has_k_and_v_of_each_attention_layer():
    assert build(tiny_config("qwen3", head_dim=24)).kv_cache_spec() == [((2, 24), (2, 24))] * 2
    assert build(tiny_config("llama", num_hidden_layers=3)).kv_cache_spec() == [((2, 16), (2, 16))] * 3


def test_bind_kv_cache_sets_every_layer_and_unbinding_only_its_own():
    model = build(tiny_config("llama"))
    attention = [layer.self_attn for layer in model.model.layers]
    backend = select_backend("triton", "cpu")
    pools = [tuple(torch.zeros(3, 4, *shape) for shape in layer) for layer in model.kv_cache_spec()]
    model.bind_kv_cache(backend, pools)
    assert model.bound_kv_cache is pools
    assert all(a.backend is backend and a.kv_cache is pool for a, pool in zip(attention, pools))
    model.unbind_kv_cache([tuple(torch.zeros(3, 4, *shape) for shape in layer) for layer in model.kv_cache_spec()])
    assert model.bound_kv_cache is pools and all(a.kv_cache is pool for a, pool in zip(attention, pools))
    model.unbind_kv_cache(pools)
    assert model.bound_kv_cache is None and all(a.kv_cache is None for a in attention)
    with pytest.raises(ValueError, match="1 KV-cache pools for 2 attention layers"):
        model.bind_kv_cache(backend, pools[:1])


def test_a_model_whose_rope_reads_positions_on_the_host_is_not_capturable():
    assert build(tiny_config("llama")).capturable
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert not build(tiny_config("llama", rope_parameters=dynamic)).capturable
