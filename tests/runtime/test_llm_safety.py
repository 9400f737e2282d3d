"""An LLM holds up under the ways it is misused: files that change under it, several threads."""

import threading

import pytest

from runtime import LLM, SamplingParams
from tests.conftest import hf_model, save_checkpoint, tiny_config

GREEDY = SamplingParams(max_tokens=6, temperature=0)
PROMPTS = [[5, 9, 13, 2], [7, 7, 1, 30, 4, 8]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(hf_model(tiny_config("llama")), tmp_path_factory.mktemp("llm") / "ckpt")


def generated(llm, prompts=PROMPTS):
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_weights_copied_with_mmap_false_outlive_their_file(checkpoint, tmp_path):
    expected = generated(LLM(str(checkpoint), device="cpu"))
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for file in checkpoint.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    llm = LLM(str(copy), device="cpu", mmap=False)
    with open(copy / "model.safetensors", "r+b") as weights:
        weights.truncate(0)  # a mapped parameter would end the process with SIGBUS on its next read
    assert generated(llm) == expected


def test_a_second_thread_is_refused_at_once_and_the_first_completes(checkpoint):
    llm = LLM(str(checkpoint), device="cpu")
    expected = generated(llm)
    stream = llm.stream(PROMPTS, GREEDY)
    deltas = [next(stream)]  # the first thread is inside its call
    refused = []

    def second():
        try:
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        except RuntimeError as exc:
            refused.append(str(exc))

    thread = threading.Thread(target=second)
    thread.start()
    thread.join(timeout=60)
    assert refused == ["LLM is not thread-safe: another thread is generating with it; use one LLM per thread, "
                       "or `zoo serve`"]
    deltas += list(stream)
    assert [sum((d.token_ids for d in deltas if d.index == i), []) for i in range(len(PROMPTS))] == expected
    # once the first thread's call has ended, another thread may call
    results = []
    thread = threading.Thread(target=lambda: results.append(generated(llm)))
    thread.start()
    thread.join(timeout=60)
    assert results == [expected]


def test_two_threads_at_once_fail_cleanly_or_complete_alike(checkpoint):
    llm = LLM(str(checkpoint), device="cpu")
    expected = generated(llm)
    barrier, results = threading.Barrier(2), []

    def run():
        barrier.wait()
        try:
            results.append(generated(llm))
        except Exception as exc:  # any other error fails the assertions below
            results.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(results) == 2 and expected in results
    assert all(r == expected or r.startswith("RuntimeError: LLM is not thread-safe") for r in results)
