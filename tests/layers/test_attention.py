"""The attention contract's score modifiers: what each backend implements, and the fallback."""

import pytest

from layers import Attention, ScoreModifiers, TorchAttentionBackend, TritonAttentionBackend, score_modifiers_used
from layers.attention import BACKENDS, select_backend


def test_a_layer_states_the_modifiers_it_uses():
    plain = Attention(64, 4, 2, 16)
    capped = Attention(64, 4, 2, 16, logit_softcap=50.0)
    assert plain.score_modifiers == ScoreModifiers() and plain.score_modifiers.used == frozenset()
    assert capped.score_modifiers.softcap == 50.0 and capped.score_modifiers.used == {"softcap"}
    assert score_modifiers_used(plain) == frozenset() and score_modifiers_used(capped) == {"softcap"}


def test_every_backend_implements_softcapping():
    assert all("softcap" in backend.score_modifiers for backend in BACKENDS.values())


def test_a_backend_lacking_a_modifier_falls_back_to_torch_with_a_warning(monkeypatch):
    monkeypatch.setattr(TritonAttentionBackend, "score_modifiers", frozenset())
    with pytest.warns(UserWarning, match="triton attention backend does not implement .*softcap"):
        backend = select_backend("triton", "cpu", frozenset({"softcap"}))
    assert type(backend) is TorchAttentionBackend
    assert type(select_backend("triton", "cpu")) is TritonAttentionBackend
