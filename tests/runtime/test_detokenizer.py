"""Streaming text: the incremental detokenizer against decoding every id at once, and the part of
a running text that is settled (no stop string can still cut it)."""

import random

import pytest
import torch

import runtime.engine
from loaders import load_tokenizer
from loaders.default_model import default_model_path
from runtime import LLM, SamplingParams
from runtime.detokenizer import IncrementalDetokenizer, text_after, token_text
from runtime.llm import settled_text
from tests.conftest import hf_model, save_checkpoint, tiny_config

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


def test_the_characters_before_an_incomplete_one_are_given_out(tokenizer):
    # SmolLM2's token 10003 holds "о" and the first byte of a Cyrillic letter; 112 the byte that ends it ("Т").
    assert tokenizer.decode([13760, 10003]) == "ко\ufffd" and tokenizer.decode([13760, 10003, 112]) == "коТ"
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.update([13760]) == "к"
    assert detokenizer.update([13760, 10003]) == "ко"  # a stop string "ко" is seen now, not a token later
    assert detokenizer.update([13760, 10003, 112]) == "коТ"
    assert detokenizer.update([13760, 10003, 112, 13760]) == "коТк"


def sentencepiece_style_tokenizer():
    """Words ``w3``..``w96`` behind SentencePiece's "▁", whose decoder drops the space a text begins with."""
    import tokenizers
    from tokenizers import decoders, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"\u2581w{i}": i for i in range(3, 97)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    model.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def byte_fallback_tokenizer():
    """Llama 2's and Mistral's kind: words behind "▁" and the 256 bytes as ``<0xNN>`` pieces."""
    import tokenizers
    from tokenizers import decoders, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{byte:02X}>": 3 + byte for byte in range(256)},
             "\u2581Hello": 259, "\u2581world": 260, "!": 261}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    model.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_a_run_of_byte_fallback_tokens_is_given_out_once_a_token_of_another_kind_ends_it():
    # A run of byte pieces decodes as a whole: "中" and a first byte of "文" are four U+FFFD, so
    # "中" given out at its third byte would be taken back. Every text given out is the start of
    # every later text, the one decoded at the end included.
    tokenizer = byte_fallback_tokenizer()
    zhong, wen = [3 + byte for byte in "中".encode()], [3 + byte for byte in "文".encode()]
    assert tokenizer.decode([259] + zhong) == "Hello中"
    assert tokenizer.decode([259] + zhong + wen[:1]) == "Hello" + "\ufffd" * 4
    prompt = [1, 260]
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice([259, 260, 261, *zhong, *wen, 3 + 0x41]) for _ in range(rng.randrange(1, 12))]
        detokenizer = IncrementalDetokenizer(tokenizer, prompt)
        given = [detokenizer.update(ids[:end]) for end in range(1, len(ids) + 1)]
        final = text_after(tokenizer, prompt, ids)
        assert final == tokenizer.decode(prompt + ids, skip_special_tokens=True)[len("world"):]
        assert all(later.startswith(earlier) for earlier, later in zip(given, given[1:] + [final])), ids
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    assert [detokenizer.update(([259] + zhong + [261])[:end]) for end in range(1, 6)] == [" Hello"] * 4 + [" Hello中!"]
    # A special token inside a run is left out of the text: the run goes on past it ("é" and a
    # second byte of it, which make the run no valid UTF-8).
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    e_acute = [3 + byte for byte in "é".encode()]
    ids = [259, *e_acute, 2, e_acute[1], 261]
    given = [detokenizer.update(ids[:end]) for end in range(1, 7)]
    assert given == [" Hello"] * 5 + [text_after(tokenizer, prompt, ids)] and "é" not in given[-1]
    # A prompt that ends in a run, or inside a character, which the generated ids go on: the text
    # is theirs alone, as they change the prompt's.
    assert text_after(tokenizer, [1, 260, *zhong], wen[:1] + [261]) == "\ufffd!"
    assert text_after(tokenizer, [1, 260, *zhong], [259]) == " Hello"


def test_a_stop_string_in_the_run_the_last_token_ends_is_cut(tmp_path, monkeypatch):
    # The detokenizer holds a run back; at the last token (max_tokens, EOS) its text is all there
    # is, and "中" in it completes the stop string.
    tokenizer = byte_fallback_tokenizer()
    path = save_checkpoint(hf_model(tiny_config("llama", vocab_size=262)), tmp_path)
    tokenizer.save_pretrained(path)
    llm = LLM(str(path), device="cpu", block_size=4)
    script = [260, *[3 + byte for byte in "中".encode()]]

    def scripted(logits, seqs, greedy=None):
        return torch.tensor([script[len(seq.output_token_ids) + seq.num_pending] for seq in seqs])

    monkeypatch.setattr(runtime.engine, "sample_tokens", scripted)
    output = llm.generate([[1, 259]], SamplingParams(max_tokens=4, ignore_eos=True, stop=["中"]), use_tqdm=False)[0]
    assert (output.token_ids, output.text, output.finish_reason) == (script, " world", "stop")
    script.append(2)  # EOS ends it: its id kept, the text cut as well
    output = llm.generate([[1, 259]], SamplingParams(max_tokens=8, stop=["中"]), use_tqdm=False)[0]
    assert (output.token_ids, output.text, output.finish_reason) == (script, " world", "stop")


def test_a_tokens_text_is_what_it_adds_after_another():
    tokenizer = sentencepiece_style_tokenizer()
    assert tokenizer.decode([43]) == "w43"
    assert token_text(tokenizer, 43) == (" w43", b" w43")
    assert token_text(byte_fallback_tokenizer(), 3 + 0xE4) == ("\ufffd", b"\xe4")


@pytest.fixture(scope="module")
def sentencepiece_llm(tmp_path_factory):
    path = save_checkpoint(hf_model(tiny_config("llama")), tmp_path_factory.mktemp("sentencepiece"))
    sentencepiece_style_tokenizer().save_pretrained(path)
    return LLM(str(path), device="cpu", block_size=4)


def test_generated_text_keeps_the_space_that_follows_the_prompt(sentencepiece_llm):
    # Decoded alone, generated ids lose their first space; after the prompt's last tokens they keep
    # it, so that prompt + text is the decoded whole, as vLLM and OpenAI give it.
    tokenizer = sentencepiece_style_tokenizer()
    prompt, generated = tokenizer("w3 w4 w5").input_ids, [71, 43, 12]
    assert tokenizer.decode(generated) == "w71 w43 w12"
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    assert [detokenizer.update(generated[:end]) for end in (1, 2, 3)] == [" w71", " w71 w43", " w71 w43 w12"]
    assert text_after(tokenizer, prompt, generated) == " w71 w43 w12"

    for stop in ([], ["zzz"]):  # the text decoded when the request ends, and as it runs
        output = sentencepiece_llm.generate(["w3 w4 w5"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                                         stop=stop), use_tqdm=False)[0]
        assert "w3 w4 w5" + output.text == tokenizer.decode(output.prompt_token_ids + output.token_ids,
                                                            skip_special_tokens=True)
        assert output.text.startswith(" w")


def test_the_text_stops_where_the_first_stop_string_to_complete_begins(sentencepiece_llm):
    """Tokens of several characters: the text is cut as if read a character at a time, at the
    first stop string to end (the longer of two that end together), whichever the list names first."""
    def cut_by_characters(text, stops):
        for end in range(len(text) + 1):
            ending = [stop for stop in stops if text[:end].endswith(stop)]
            if ending:
                return text[:end - max(map(len, ending))]
        return None

    params = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    free = sentencepiece_llm.generate(["w3 w4 w5"], SamplingParams(**params), use_tqdm=False)[0]
    words = free.text.split()
    assert len(words) == 6
    # The second word is one token " wNN": "wNN" begins before its first digit, which ends first.
    second, digit = words[1], words[1][1]
    assert digit not in free.text[:free.text.index(second)]
    for stops in ([second, digit], [digit, second], [" " + second, second[:2]], [second, " " + second]):
        expected = cut_by_characters(free.text, stops)
        stopped = sentencepiece_llm.generate(["w3 w4 w5"], SamplingParams(**params, stop=stops), use_tqdm=False)[0]
        assert (stopped.text, stopped.finish_reason) == (expected, "stop"), stops
        assert free.text.startswith(stopped.text) and not any(stop in stopped.text for stop in stops)


def test_a_prompt_that_ends_inside_a_character_is_no_context(tokenizer):
    prompt, generated = [13760, 10003], [112, 13760, 13760]  # "ко" + the first byte of "Т", its last byte, "к", "к"
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    given = [detokenizer.update(generated[:end]) for end in range(1, 4)]
    assert given == ["", "\ufffdк", "\ufffdкк"] and text_after(tokenizer, prompt, generated) == "\ufffdкк"


def test_each_call_decodes_a_short_window(tokenizer):
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 40, add_special_tokens=False)
    windows = []
    decode = tokenizer.decode

    class Counting:
        def decode(self, token_ids, **kwargs):
            windows.append(len(token_ids))
            return decode(token_ids, **kwargs)

        all_special_ids = tokenizer.all_special_ids

        def convert_ids_to_tokens(self, token_id):
            return tokenizer.convert_ids_to_tokens(token_id)

    detokenizer = IncrementalDetokenizer(Counting())
    for end in range(1, len(ids) + 1):
        detokenizer.update(ids[:end])
    assert len(ids) > 300 and max(windows) <= 2
    assert detokenizer.text == decode(ids)


def test_settled_text_holds_back_exactly_the_longest_tail_that_begins_a_stop_string():
    def held_by_definition(text: str, stop: str) -> int:
        return max((n for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)

    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab\ufffd") for _ in range(rng.randrange(0, 12)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(1, 4))]
        stripped = text.rstrip("\ufffd")
        held = max(held_by_definition(stripped, stop) for stop in stops)
        assert settled_text(text, stops) == stripped[:len(stripped) - held], (text, stops)
    # A stop string of one character repeated: every place is tried, the longest tail held.
    assert settled_text("x" + "a" * 5000, ["a" * 1024]) == "x" + "a" * (5000 - 1023)


def test_the_bytes_of_tokens_that_split_a_character_join_into_its_utf8(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    split = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert len(split) >= 4  # the giraffe and the CJK characters are split over byte-level tokens
    assert b"".join(token_text(tokenizer, i)[1] for i in ids) == tokenizer.decode(ids).encode()
