"""Tied embeddings as transformers loads them: a checkpoint may hold the shared weight under the
embedding's name, the head's, or both; two different copies untie it."""

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from loaders import CheckpointError
from models import AutoModelForCausalLM
from tests.conftest import INIT_STD, hf_model, save_checkpoint, tiny_config

HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


@pytest.fixture
def tied_checkpoint(tmp_path):
    """rewrite(tensors -> tensors) -> a tied llama checkpoint whose safetensors file holds them."""

    def rewrite(edit):
        path = save_checkpoint(hf_model(tiny_config("llama", tie_word_embeddings=True)), tmp_path / "ckpt")
        tensors = load_file(path / "model.safetensors")
        assert HEAD not in tensors  # transformers saves a tied weight once
        save_file(edit(tensors), path / "model.safetensors", metadata={"format": "pt"})
        return path

    return rewrite


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits if isinstance(model, transformers.PreTrainedModel) else model(ids)


def compare_with_hf(path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(0))
    expected = logits(hf, ids)
    for ours in (AutoModelForCausalLM.from_pretrained(path), AutoModelForCausalLM.from_hf(hf)):
        torch.testing.assert_close(logits(ours, ids), expected, rtol=1e-5, atol=1e-5)
    return hf


def test_a_head_saved_beside_the_embedding_it_repeats_stays_tied(tied_checkpoint):
    path = tied_checkpoint(lambda t: {**t, HEAD: t[EMBEDDING].clone()})
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    compare_with_hf(path)


def test_the_weight_under_the_head_s_name_alone_fills_both(tied_checkpoint):
    path = tied_checkpoint(lambda t: {**{k: v for k, v in t.items() if k != EMBEDDING}, HEAD: t[EMBEDDING]})
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    compare_with_hf(path)


def test_a_head_that_differs_from_the_embedding_unties_them_with_a_warning(tied_checkpoint):
    # a head of its own on the embedding's scale: logits within compare_with_hf's float32 bar
    path = tied_checkpoint(lambda t: {**t, HEAD: INIT_STD * torch.randn(t[EMBEDDING].shape,
                                                                        generator=torch.Generator().manual_seed(1))})
    with pytest.warns(UserWarning, match=rf"ckpt/model\.safetensors: {HEAD} and {EMBEDDING} hold different values, "
                                         r"but the config ties them \(tie_word_embeddings\); loaded untied"):
        model = AutoModelForCausalLM.from_pretrained(path)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, load_file(path / "model.safetensors")[HEAD])
    with pytest.warns(UserWarning, match="loaded untied"):
        hf = compare_with_hf(path)  # transformers unties them too; from_hf follows its state dict
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()


def test_a_head_of_another_shape_is_named(tied_checkpoint):
    path = tied_checkpoint(lambda t: {**t, HEAD: torch.zeros(3, 3, dtype=torch.int32)})
    with pytest.warns(UserWarning, match="loaded untied"), \
            pytest.raises(CheckpointError, match=rf"tensor '{HEAD}' in .*model\.safetensors: expected shape \(97, 64\), "
                                                 r"got \(3, 3\)"):
        AutoModelForCausalLM.from_pretrained(path)


def test_neither_name_is_missing_as_either(tied_checkpoint):
    path = tied_checkpoint(lambda t: {k: v for k, v in t.items() if k != EMBEDDING})
    with pytest.raises(CheckpointError, match=rf"missing tensors: {EMBEDDING} or {HEAD}"):
        AutoModelForCausalLM.from_pretrained(path)
