"""Streaming text: the incremental detokenizer against decoding every id at once."""

import random

import pytest

from loaders import load_tokenizer
from loaders.default_model import default_model_path
from runtime.detokenizer import IncrementalDetokenizer

TEXT = "Zoo 🦒 serves: naïve café — 東京の動物園, 42 × 7 = 294.\n  def f(x):\n\treturn x"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(default_model_path()))


def test_text_grows_as_decoding_everything_gives_it_and_never_shows_half_a_character(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(tokenizer.decode(ids[:3])) < len(TEXT)  # the text spans many tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    for end in range(1, len(ids) + 1):
        text = detokenizer.update(ids[:end])
        assert "\ufffd" not in text
        assert TEXT.startswith(text)
        if "\ufffd" not in tokenizer.decode(ids[:end]):
            assert text == tokenizer.decode(ids[:end])
    assert text == TEXT


def test_random_ids_in_uneven_steps(tokenizer):
    rng = random.Random(0)
    ids = [rng.randrange(len(tokenizer)) for _ in range(300)]
    detokenizer = IncrementalDetokenizer(tokenizer)
    end = 0
    while end < len(ids):
        end = min(len(ids), end + rng.choice([1, 1, 2, 3]))
        text = detokenizer.update(ids[:end])
        full = tokenizer.decode(ids[:end], skip_special_tokens=True)
        assert full.startswith(text)
        if not full.endswith("\ufffd"):
            assert text == full


def test_each_call_decodes_a_short_window(tokenizer):
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 40, add_special_tokens=False)
    windows = []
    decode = tokenizer.decode

    class Counting:
        def decode(self, token_ids, **kwargs):
            windows.append(len(token_ids))
            return decode(token_ids, **kwargs)

    detokenizer = IncrementalDetokenizer(Counting())
    for end in range(1, len(ids) + 1):
        detokenizer.update(ids[:end])
    assert len(ids) > 300 and max(windows) <= 2
    assert detokenizer.text == decode(ids)
