"""``zoo serve`` as its clients see it: the real server on a loopback port, a tiny random Llama
with a character-level tokenizer, the real ``openai`` client. Each token of the tokenizer is one
character (special tokens none), so equal texts are equal tokens."""

import asyncio
import base64
import contextlib
import http.client
import json
import logging
import os
import re
import signal
import socket
import string
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import transformers
import uvicorn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from runtime import LLM, SamplingParams
from runtime.engine_loop import EngineLoop
from runtime.server import Server, build_app
from tests.conftest import hf_model, save_checkpoint, tiny_config

MODEL = "tiny-llama"
KEY = "test-key"
MAX_MODEL_LEN = 1024
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ROOT = Path(__file__).resolve().parents[2]


def save_chat_checkpoint(path: Path) -> Path:
    """A tiny random Llama whose tokenizer has a token per printable character and a ChatML template."""
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials + [c for c in string.printable if c not in "\t\r\x0b\x0c"])}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="<unk>", max_input_chars_per_word=10**6))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|im_end|>",
                                                additional_special_tokens=specials[1:])
    fast.chat_template = CHAT_TEMPLATE
    config = tiny_config("llama", vocab_size=len(vocab), max_position_embeddings=MAX_MODEL_LEN,
                         eos_token_id=vocab["<|im_end|>"])
    save_checkpoint(hf_model(config), path)
    fast.save_pretrained(path)
    return path


def break_chat_template(path: Path, file: str) -> Path:
    """The chat checkpoint at ``path`` with a template jinja cannot compile (a for without its
    endfor) in ``file``: chat_template.jinja, or tokenizer_config.json's "chat_template". Returns
    the file's path."""
    broken = "{% for m in messages %}{{ m['content'] }}"
    (path / "chat_template.jinja").unlink()
    if file == "chat_template.jinja":
        (path / file).write_text(broken)
    else:
        fields = json.loads((path / file).read_text())
        (path / file).write_text(json.dumps({**fields, "chat_template": broken}))
    return path / file


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_chat_checkpoint(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """An LLM of its own on the same checkpoint: what the server's answers must equal."""
    return LLM(str(checkpoint), device="cpu")


@contextlib.contextmanager
def serving(llm: LLM, shutdown_grace_s: float | None = None, api_key: str | None = KEY):
    """The server's app for ``llm`` under uvicorn in a thread; yields its base URL."""
    port = free_port()
    uvicorn_server = Server(uvicorn.Config(build_app(llm, MODEL, api_key=api_key), host="127.0.0.1", port=port,
                                           log_level="warning", timeout_graceful_shutdown=shutdown_grace_s))
    thread = threading.Thread(target=uvicorn_server.run)
    thread.start()
    deadline = time.monotonic() + 30
    while not uvicorn_server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    uvicorn_server.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def server(checkpoint):
    """(base URL, the served LLM)."""
    llm = LLM(str(checkpoint), device="cpu")
    with serving(llm) as base_url:
        yield base_url, llm


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0, timeout=60)


def post(url: str, body, key: str | None = KEY) -> tuple[int, dict]:
    """(status, JSON body) of a POST; ``body`` bytes go as they are, anything else as JSON."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return fetch(urllib.request.Request(url, data=data, method="POST", headers=headers(key)))


def get(url: str, key: str | None = KEY) -> tuple[int, str]:
    status, body = fetch(urllib.request.Request(url, headers=headers(key)), parse=False)
    return status, body


def headers(key: str | None) -> dict:
    found = {"Content-Type": "application/json"}
    if key is not None:
        found["Authorization"] = f"Bearer {key}"
    return found


def fetch(request, parse=True):
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, body = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read().decode()
    return status, json.loads(body) if parse else body


def metric(base_url: str, name: str) -> float:
    _, text = get(f"{base_url}/metrics")
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
GREEDY = dict(max_tokens=12, temperature=0.0)
SEEDED = dict(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)


def test_a_conversation_the_template_cannot_take_is_named_by_its_place(reference):
    with pytest.raises(ValueError, match=r"^conversation 1: message 0: its content is a string or a list of parts, "
                                         r"got None$"):
        reference.chat([CONVERSATION, [{"role": "user", "content": None}]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^message 0: its content"):  # one conversation: its messages alone
        reference.chat([{"role": "user", "content": None}], use_tqdm=False)


@pytest.mark.parametrize("settings", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_chat_equals_llm_chat_whole_and_streamed(settings, client, reference):
    expected = reference.chat(CONVERSATION, SamplingParams(**settings), use_tqdm=False)[0]
    assert expected.error is None and len(expected.token_ids) > 0

    whole = client.chat.completions.create(model=MODEL, messages=CONVERSATION, **settings)
    assert whole.model == MODEL and whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].finish_reason == expected.finish_reason
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        len(expected.prompt_token_ids), len(expected.token_ids))
    assert whole.usage.total_tokens == len(expected.prompt_token_ids) + len(expected.token_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=CONVERSATION, stream=True,
                                                 stream_options={"include_usage": True}, **settings))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        expected.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("settings", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_completions_of_text_and_token_ids_equal_llm_generate(settings, client, reference):
    text_prompt, id_prompt = "The quick brown fox", [5, 17, 42, 60, 33, 8]
    expected = reference.generate([text_prompt, id_prompt], SamplingParams(**settings), use_tqdm=False)
    for prompt, output in zip((text_prompt, id_prompt), expected):
        whole = client.completions.create(model=MODEL, prompt=prompt, **settings)
        assert whole.choices[0].text == output.text
        assert whole.usage.prompt_tokens == len(output.prompt_token_ids)
        assert whole.usage.completion_tokens == len(output.token_ids)
        streamed = list(client.completions.create(model=MODEL, prompt=prompt, stream=True, **settings))
        assert "".join(c.choices[0].text for c in streamed) == output.text
        assert streamed[-1].choices[0].finish_reason == output.finish_reason
    # Several prompts in one request: a choice each, in order.
    batch = client.completions.create(model=MODEL, prompt=[text_prompt, "Hi"], **settings)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == expected[0].text


def test_logprobs_are_the_models(client, reference):
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    expected = reference.chat(CONVERSATION, params, use_tqdm=False)[0]
    tokenizer = reference.tokenizer

    chat = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=6, temperature=0.0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in expected.token_ids]
    for item, token, entry in zip(content, expected.token_ids, expected.logprobs):
        assert item.logprob == pytest.approx(entry[token], abs=1e-5)
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 3
        best = sorted(entry.values(), reverse=True)[:3]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(best, abs=1e-5)
        assert item.top_logprobs[0].token == item.token  # greedy: the token is the most likely

    prompt = "Once upon"
    expected = reference.generate(prompt, params, use_tqdm=False)[0]
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0.0, logprobs=3)
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in expected.token_ids]
    assert logprobs.token_logprobs == pytest.approx([e[t] for t, e in zip(expected.token_ids, expected.logprobs)],
                                                    abs=1e-5)
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(6)]
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0.0, logprobs=3,
                                         stream=True)
    chunks = [chunk.choices[0].logprobs for chunk in streamed if chunk.choices[0].logprobs is not None]
    assert len(chunks) > 1  # a chunk per step, each offset where the text before it ends
    assert [offset for chunk in chunks for offset in chunk.text_offset] == logprobs.text_offset


def test_penalties_stop_strings_and_n_choices_equal_llm_generate(client, reference):
    prompt = "abcabcabc"
    penalised = SamplingParams(max_tokens=16, temperature=0.0, presence_penalty=0.8, frequency_penalty=0.5)
    expected = reference.generate(prompt, penalised, use_tqdm=False)[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.0,
                                    presence_penalty=0.8, frequency_penalty=0.5)
    assert got.choices[0].text == expected.text

    # A stop string: the text the first few characters after it would have been.
    unstopped = reference.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0].text
    stop = unstopped[3:5]
    stopped = reference.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, stop=[stop]),
                                 use_tqdm=False)[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    for stream in (False, True):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.0, stop=stop,
                                             stream=stream)
        chunks = list(response) if stream else [response]
        assert "".join(c.choices[0].text for c in chunks) == stopped.text
        assert chunks[-1].choices[0].finish_reason == "stop"

    # n seeded choices: choice i draws with seed + i.
    response = client.chat.completions.create(model=MODEL, messages=CONVERSATION, n=3, seed=10, max_tokens=8)
    expected = reference.chat([CONVERSATION] * 3, [SamplingParams(max_tokens=8, seed=10 + i) for i in range(3)],
                              use_tqdm=False)
    assert [c.message.content for c in response.choices] == [o.text for o in expected]
    assert len({o.text for o in expected}) > 1
    # The prompt counts once, the choices' tokens all.
    assert response.usage.prompt_tokens == len(expected[0].prompt_token_ids)
    assert response.usage.completion_tokens == sum(len(o.token_ids) for o in expected)
    # Past the largest seed, choice i's wraps modulo 2**64.
    response = client.completions.create(model=MODEL, prompt=prompt, n=2, seed=2**64 - 1, max_tokens=8)
    wrapped = reference.generate([prompt] * 2, [SamplingParams(max_tokens=8, seed=seed) for seed in (2**64 - 1, 0)],
                                 use_tqdm=False)
    assert [c.text for c in response.choices] == [o.text for o in wrapped]


def test_top_k_min_p_and_repetition_penalty_reach_the_engine(client, reference):
    # Fields the OpenAI client sends in its extra body: top_k 1 or a min_p of 0.999 at temperature 1
    # draws the greedy tokens (the same seed without them does not), a repetition penalty answers
    # as LLM.generate with it (and not as without it).
    prompt = "abcabcabc"
    greedy = reference.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0].text
    drawn = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=3)
    assert client.completions.create(**drawn).choices[0].text != greedy
    for extra in ({"top_k": 1}, {"min_p": 0.999}):
        assert client.completions.create(**drawn, extra_body=extra).choices[0].text == greedy, extra
    penalised = reference.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.8),
                                   use_tqdm=False)[0].text
    assert penalised != greedy
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.0,
                                    extra_body={"repetition_penalty": 1.8})
    assert got.choices[0].text == penalised


def test_32_concurrent_streams_share_the_engine_and_all_finish_correctly(server, client, reference):
    base_url, llm = server
    prompts = [f"Request {i}: " + "xyz"[i % 3] * (i % 7) for i in range(32)]
    expected = reference.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                                  use_tqdm=False)
    peak_running = []

    def watch():
        while len(peak_running) < 400 and not done.is_set():
            peak_running.append(len(llm.engine.scheduler.running))
            time.sleep(0.005)

    def stream(prompt: str) -> str:
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in chunks)

    done = threading.Event()
    watcher = threading.Thread(target=watch)
    watcher.start()
    with ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(stream, prompts))
    done.set()
    watcher.join()
    assert texts == [o.text for o in expected]
    assert max(peak_running) > 1  # steps batched requests of different clients
    assert metric(base_url, "zoo:num_requests_running") == 0


@pytest.mark.parametrize("stream", [True, False], ids=["mid-stream", "before-its-whole-answer"])
def test_a_client_gone_frees_its_blocks_at_once(stream, server, client):
    base_url, _ = server
    host, port = base_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": MODEL, "prompt": "A long story:", "max_tokens": 1000, "stream": stream,
                       "ignore_eos": True})
    connection.request("POST", "/v1/completions", body, headers(KEY))
    if stream:
        response = connection.getresponse()
        assert response.status == 200
        events = [response.readline() for _ in range(6)]  # three events, each a line and a blank one
        assert all(e.startswith(b"data: ") for e in events[::2])
    deadline = time.monotonic() + 30
    while metric(base_url, "zoo:num_requests_running") == 0:
        assert time.monotonic() < deadline, "the request did not start"
        time.sleep(0.01)
    assert metric(base_url, "zoo:kv_cache_usage_perc") > 0
    generated = metric(base_url, "zoo:generation_tokens_total")
    connection.close()

    deadline = time.monotonic() + 5
    while metric(base_url, "zoo:kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline, "the blocks of a request whose client left were not freed"
        time.sleep(0.02)
    assert metric(base_url, "zoo:num_requests_running") == 0
    assert metric(base_url, "zoo:num_requests_waiting") == 0
    assert metric(base_url, "zoo:generation_tokens_total") < generated + 900  # it stopped long before 1000 tokens
    # The server carries on.
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_a_client_gone_while_sending_its_request_is_no_error(server, client, caplog):
    host, port = server[0].removeprefix("http://").split(":")
    with caplog.at_level(logging.INFO):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"model\"".encode())
            time.sleep(0.2)
        time.sleep(0.5)
    assert "Traceback" not in caplog.text and "ClientDisconnect" not in caplog.text, caplog.text
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


@contextlib.contextmanager
def slowly_preparing_engine_loop(checkpoint: Path, slow_prompt: str = "long"):
    """An EngineLoop over an LLM of its own, whose prompt threads, on ``slow_prompt``, set the
    first event and wait for the second; yields (the engine loop, its LLM, the two events)."""
    llm = LLM(str(checkpoint), device="cpu")
    preparing, release = threading.Event(), threading.Event()
    prepare_prompt = llm.engine.prepare_prompt

    def prepare_slowly(prompt):
        if prompt == slow_prompt:
            preparing.set()
            release.wait(timeout=60)
        return prepare_prompt(prompt)

    llm.engine.prepare_prompt = prepare_slowly
    engine_loop = EngineLoop(llm)
    try:
        yield engine_loop, llm, preparing, release
    finally:
        release.set()
        engine_loop.stop()


async def generated_tokens(engine_loop: EngineLoop, prompt: str, max_tokens: int) -> list[int]:
    group = await engine_loop.submit([prompt], [SamplingParams(max_tokens=max_tokens, ignore_eos=True)])
    return [token for delta in [d async for d in group.deltas()] for token in delta.token_ids]


def test_a_caller_gone_while_its_prompt_is_prepared_leaves_the_engine_serving(checkpoint):
    async def leave_while_prepared():
        submitting = asyncio.ensure_future(engine_loop.submit(["long"], [SamplingParams(max_tokens=4)]))
        assert await asyncio.to_thread(preparing.wait, 30)
        submitting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submitting
        release.set()
        return await asyncio.wait_for(generated_tokens(engine_loop, "hi", 3), timeout=30)

    with slowly_preparing_engine_loop(checkpoint) as (engine_loop, llm, preparing, release):
        assert len(asyncio.run(leave_while_prepared())) == 3
        assert engine_loop.unavailable is None
        assert not llm.engine.has_unfinished()  # the request of the caller that left never entered


def test_a_prompt_being_tokenized_holds_up_no_other_submission(checkpoint):
    async def others_while_one_is_prepared():
        long = asyncio.ensure_future(generated_tokens(engine_loop, "long", 2))
        assert await asyncio.to_thread(preparing.wait, 30)
        others = await asyncio.wait_for(asyncio.gather(*(generated_tokens(engine_loop, f"hi {i}", 3)
                                                         for i in range(8))), timeout=30)
        assert not long.done()
        release.set()
        return others, await long

    with slowly_preparing_engine_loop(checkpoint) as (engine_loop, _, preparing, release):
        others, long = asyncio.run(others_while_one_is_prepared())
        assert [len(tokens) for tokens in others] == [3] * 8 and len(long) == 2


def test_stopping_waits_for_no_prompt_being_tokenized_and_refuses_its_request(checkpoint):
    with slowly_preparing_engine_loop(checkpoint) as (engine_loop, _, preparing, release):
        with ThreadPoolExecutor(1) as pool:
            refused = pool.submit(asyncio.run, generated_tokens(engine_loop, "long", 4))
            assert preparing.wait(timeout=30)
            started = time.monotonic()
            engine_loop.stop()
            assert time.monotonic() - started < 10, "stop waited for a prompt being tokenized"
            release.set()
            with pytest.raises(RuntimeError, match="the server is shutting down"):
                refused.result(timeout=30)
        assert engine_loop.unavailable == "the engine loop has stopped"


def test_metrics_count_tokens_and_latencies(server, client):
    base_url, _ = server
    before = {name: metric(base_url, name) for name in (
        "zoo:prompt_tokens_total", "zoo:generation_tokens_total", "zoo:time_to_first_token_seconds_count",
        "zoo:inter_token_latency_seconds_count")}
    usage = client.completions.create(model=MODEL, prompt="Count me", max_tokens=5, temperature=0.0,
                                      extra_body={"ignore_eos": True}).usage
    assert metric(base_url, "zoo:prompt_tokens_total") == before["zoo:prompt_tokens_total"] + usage.prompt_tokens
    assert metric(base_url, "zoo:generation_tokens_total") == before["zoo:generation_tokens_total"] + 5
    assert metric(base_url, "zoo:time_to_first_token_seconds_count") == (
        before["zoo:time_to_first_token_seconds_count"] + 1)
    assert metric(base_url, "zoo:inter_token_latency_seconds_count") == (
        before["zoo:inter_token_latency_seconds_count"] + 4)


CHAT = {"model": MODEL, "messages": CONVERSATION}
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAAAAAA6fptVAAAACklEQVR4nGNgAAAAAgABSK+kcQAAAABJRU5ErkJggg=="  # a 1x1 grey PNG
BAD_REQUESTS = {
    # name: (route, body, status, param, words the message must contain)
    "malformed JSON": ("chat/completions", b'{"model": "tiny-llama", "messages": [', 400, None, "not valid JSON"),
    "not an object": ("completions", b"[1, 2]", 400, None, "object"),
    "wrong type": ("chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature", "'hot'"),
    "wrong type in a message": ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400,
                                "messages[0].content", "5"),
    "unknown role": ("chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, 400,
                     "messages[0].role", "'robot'"),
    "wrong type in an image part": ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": 5}}]}]}, 400, "messages[0].content[0].image_url.url", "5"),
    "wrong type in a text part": ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": 3}]}]}, 400, "messages[0].content[0].text", "3"),
    "image for a text model": ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}}]}]},
                               400, "messages[0].content[1]", "messages[0].content[1]: LlamaForCausalLM takes no images"),
    # Not decoded: a text model refuses any image first.
    "unreadable image for a text model": ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "messages[0].content[0]",
                                          "takes no images"),
    "unknown content part": ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "audio", "audio": "..."}]}]}, 400, "messages[0].content[0]", "audio"),
    "no messages": ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "at least 1"),
    "missing prompt": ("completions", {"model": MODEL}, 400, "prompt", "required"),
    "unknown field": ("completions", {"model": MODEL, "prompt": "hi", "best_of": 2}, 400, "best_of",
                      "Unrecognized request argument"),
    "unknown model": ("chat/completions", {**CHAT, "model": "gpt-9"}, 404, "model", "gpt-9"),
    "prompt over max_model_len": ("completions", {"model": MODEL, "prompt": "x" * MAX_MODEL_LEN}, 400, "prompt",
                                  f"max_model_len is {MAX_MODEL_LEN}"),
    "chat over max_model_len": ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "y" * MAX_MODEL_LEN}]},
                                400, "messages", "max_model_len"),
    "token id outside the vocabulary": ("completions", {"model": MODEL, "prompt": [1, 5000]}, 400, "prompt",
                                        "5000"),
    "empty prompt in a list": ("completions", {"model": MODEL, "prompt": ["x", ""]}, 400, "prompt[1]",
                               "prompt[1]: the prompt is empty"),
    "empty prompt in a list, n 2": ("completions", {"model": MODEL, "prompt": ["x", "y", ""], "n": 2}, 400,
                                    "prompt[2]", "prompt[2]: the prompt is empty"),
    "empty token ids in a list": ("completions", {"model": MODEL, "prompt": [[5], []]}, 400, "prompt[1]",
                                  "prompt[1]: the prompt is empty"),
    "prompt in a list over max_model_len": ("completions", {"model": MODEL, "prompt": ["hi", "x" * MAX_MODEL_LEN]},
                                            400, "prompt[1]", f"max_model_len is {MAX_MODEL_LEN}"),
    "token id outside the vocabulary in a list": ("completions", {"model": MODEL, "prompt": [[1, 2], [1, 5000]]}, 400,
                                                  "prompt[1]", "5000"),
    "wrong type in a prompt list": ("completions", {"model": MODEL, "prompt": ["x", 5]}, 400, "prompt[1]", "5"),
    "wrong type in a token-id list": ("completions", {"model": MODEL, "prompt": [[1, 2], [3, "x"]]}, 400,
                                      "prompt[1][1]", "'x'"),
    "text in a prompt of token ids": ("completions", {"model": MODEL, "prompt": [1, "x"]}, 400, "prompt[1]", "'x'"),
    "text among token-id prompts": ("completions", {"model": MODEL, "prompt": [[1], "x"]}, 400, "prompt[1]", "'x'"),
    "negative temperature": ("chat/completions", {**CHAT, "temperature": -0.5}, 400, "temperature", ">= 0"),
    "top_p 0": ("completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p", "(0, 1]"),
    "max_tokens 0": ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens",
                     "positive"),
    "max_completion_tokens 0": ("chat/completions", {**CHAT, "max_completion_tokens": 0}, 400,
                                "max_completion_tokens", "max_completion_tokens must be a positive integer"),
    "seed past the largest": ("completions", {"model": MODEL, "prompt": "hi", "seed": 2**64}, 400, "seed", "2**64"),
    "presence_penalty 3": ("chat/completions", {**CHAT, "presence_penalty": 3}, 400, "presence_penalty", "[-2, 2]"),
    "n 0": ("chat/completions", {**CHAT, "n": 0}, 400, "n", "greater than or equal to 1"),
    "n over 128": ("completions", {"model": MODEL, "prompt": "hi", "n": 1_000_000, "max_tokens": 1}, 400, "n",
                   "less than or equal to 128"),
    "prompts times n over 2048": ("completions", {"model": MODEL, "prompt": ["hi"] * 17, "n": 128, "max_tokens": 1},
                                  400, "prompt", "17 prompts times n=128 make 2176 choices; a request takes at "
                                                 "most 2048"),
    "a stop sequence of 1,025 characters": ("completions", {"model": MODEL, "prompt": "hi", "stop": ["a", "b" * 1025]},
                                            400, "stop[1]", "stop[1]: a stop sequence takes at most 1024 characters, "
                                                            "got 1025"),
    "stream_options, not streamed": ("completions", {"model": MODEL, "prompt": "hi",
                                                     "stream_options": {"include_usage": True}}, 400, "stream_options",
                                     "set stream to true"),
    "257 stop token ids": ("completions", {"model": MODEL, "prompt": "hi", "stop_token_ids": [1] * 257}, 400,
                           "stop_token_ids", "stop_token_ids takes at most 256 ids, got 257"),
    "17 stop sequences": ("chat/completions", {**CHAT, "stop": [f"s{i}" for i in range(17)]}, 400, "stop",
                          "at most 16 sequences, got 17"),
    "top_logprobs 30": ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs",
                        "top_logprobs must be an integer in [0, 20], got 30"),
    "top_logprobs without logprobs": ("chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs",
                                      "logprobs"),
    "empty stop string": ("completions", {"model": MODEL, "prompt": "hi", "stop": [""]}, 400, "stop", "stop"),
    "echo": ("completions", {"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo", "echo"),
    "max_tokens past the context": ("completions", {"model": MODEL, "prompt": [[5], [5] * (MAX_MODEL_LEN - 10)],
                                                    "max_tokens": 11}, 400, "max_tokens",
                                    f"max_tokens: prompt[1]: {MAX_MODEL_LEN - 10} prompt tokens and max_tokens=11 make "
                                    f"{MAX_MODEL_LEN + 1}, past max_model_len ({MAX_MODEL_LEN}); lower max_tokens"),
    "max_completion_tokens past the context": ("chat/completions", {**CHAT, "max_tokens": 1,
                                                                     "max_completion_tokens": MAX_MODEL_LEN},
                                               400, "max_completion_tokens", "messages: "),
    "streamed, too long": ("completions", {"model": MODEL, "prompt": "z" * MAX_MODEL_LEN, "stream": True}, 400, "prompt",
                           "max_model_len"),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_requests_get_an_openai_error_naming_the_culprit(name, server):
    route, body, status, param, words = BAD_REQUESTS[name]
    got_status, got = post(f"{server[0]}/v1/{route}", body)
    assert got_status == status, got
    error = got["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"], error["message"]


@pytest.mark.parametrize("file", ["chat_template.jinja", "tokenizer_config.json"])
def test_a_chat_template_that_does_not_compile_is_named_at_load_and_fails_chats_not_generation(file, tmp_path, caplog):
    template = break_chat_template(save_chat_checkpoint(tmp_path / "ckpt"), file)
    named = rf"{re.escape(str(template))}: the chat template does not compile \(line 1: Unexpected end of template"
    with caplog.at_level(logging.WARNING, logger="runtime.llm"):
        llm = LLM(str(template.parent), device="cpu")
    assert re.search(named, caplog.text), caplog.text
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(llm.generate(["hi"], params, use_tqdm=False)[0].token_ids) == 3
    with pytest.raises(ValueError, match=named):
        llm.chat(CONVERSATION, params, use_tqdm=False)
    with serving(llm) as base_url:
        status, body = post(f"{base_url}/v1/chat/completions", {**CHAT, "max_tokens": 3})
        assert status == 400 and body["error"]["param"] == "messages"
        assert re.search(named, body["error"]["message"]), body
        status, body = post(f"{base_url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_a_prompt_of_millions_of_token_ids_is_parsed_about_as_fast_as_its_json():
    """The event loop parses each body: a prompt's form is read off its first element and only that
    form validated (also validating 2M token ids as texts, an error per id, took 7x json.loads)."""
    from runtime.openai_protocol import CompletionRequest, parse_request

    body = json.dumps({"model": MODEL, "prompt": list(range(2_000_000))}).encode()
    assert len(parse_request(CompletionRequest, body).prompt) == 2_000_000

    def fastest(parse) -> float:  # of three: a busy machine slows single calls unevenly
        times = []
        for _ in range(3):
            started = time.perf_counter()
            parse(body)
            times.append(time.perf_counter() - started)
        return min(times)

    assert fastest(lambda raw: parse_request(CompletionRequest, raw)) < 3 * fastest(json.loads)


@pytest.mark.parametrize("route, field, bad_list, param", [
    ("chat/completions", "messages", [1] * 2_000_000, "messages[0]"),
    ("chat/completions", "stop", ["a", *[1] * 2_000_000], "stop[1]"),
    ("completions", "stop_token_ids", [""] * 2_000_000, "stop_token_ids[0]"),
    ("completions", "prompt", [1, *[True] * 2_000_000], "prompt[1]"),
    ("completions", "prompt", [[1], [1, *[True] * 2_000_000]], "prompt[1][1]"),
])
def test_a_list_of_millions_of_bad_elements_is_refused_at_its_first(route, field, bad_list, param):
    """One error, not one per element (a 7.6 MiB body of them took 24 s and 5.5 GiB, the event loop held)."""
    from runtime.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request

    request = ChatCompletionRequest if route == "chat/completions" else CompletionRequest
    body = json.dumps({"model": MODEL, **({"messages": CONVERSATION} if field != "messages" else {}),
                       **({"prompt": "hi"} if request is CompletionRequest and field != "prompt" else {}),
                       field: bad_list}).encode()
    started = time.perf_counter()
    json.loads(body)
    json_s = time.perf_counter() - started
    started = time.perf_counter()
    with pytest.raises(APIError) as refused:
        parse_request(request, body)
    assert time.perf_counter() - started < max(1.0, 20 * json_s)  # one error per element: seconds
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message


def test_a_body_past_32_mib_is_refused_before_it_is_read(server, client):
    host, port = server[0].removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.putrequest("POST", "/v1/completions")
    for name, value in {**headers(KEY), "Content-Length": str(32 * 2**20 + 1)}.items():
        connection.putheader(name, value)
    connection.endheaders(b'{"model": "tiny-llama", "prompt": "')  # the rest is never sent
    response = connection.getresponse()
    error = json.loads(response.read())["error"]
    connection.close()
    assert response.status == 413 and set(error) == {"message", "type", "param", "code"}, error
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_a_request_while_the_engine_is_unavailable_is_a_503_as_health_says(checkpoint, monkeypatch):
    llm = LLM(str(checkpoint), device="cpu")
    with serving(llm) as base_url:
        monkeypatch.setattr(LLM, "failure", property(lambda self: "rank 1 has failed"))
        assert get(f"{base_url}/health", key=None) == (503, '{"status":"rank 1 has failed"}')
        status, body = post(f"{base_url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert status == 503 and body["error"] == {"message": "rank 1 has failed", "type": "server_error",
                                                   "param": None, "code": "service_unavailable"}


def test_a_tool_message_reaches_the_template_with_the_call_it_answers(client):
    from runtime.openai_protocol import ChatCompletionRequest

    messages = [*CONVERSATION, {"role": "assistant", "content": "x"},
                {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    assert ChatCompletionRequest(model=MODEL, messages=messages).conversation()[-1] == {
        "role": "tool", "content": "42", "tool_call_id": "call_1"}
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 2


def test_bad_requests_leave_the_server_serving_the_others(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=CONVERSATION, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CONVERSATION)
    with pytest.raises(openai.BadRequestError, match="prompt is empty") as caught:
        client.completions.create(model=MODEL, prompt=["Hi", ""], max_tokens=3)
    assert caught.value.param == "prompt[1]"
    assert client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=3).usage.completion_tokens


def test_the_api_key_guards_every_route_but_health(server):
    base_url, _ = server
    assert get(f"{base_url}/health", key=None) == (200, '{"status":"ok"}')
    for key in (None, "wrong-key"):
        for status, body in (get(f"{base_url}/v1/models", key), get(f"{base_url}/metrics", key),
                             post(f"{base_url}/v1/completions", {"model": MODEL, "prompt": "hi"}, key)):
            assert status == 401
            error = body["error"] if isinstance(body, dict) else json.loads(body)["error"]
            assert error["code"] == "invalid_api_key"
    status, body = get(f"{base_url}/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL
    for authorization, status in ((KEY, 401), (f"Basic {KEY}", 401), (f"bearer {KEY}", 200)):  # the scheme's case is free
        assert fetch(urllib.request.Request(f"{base_url}/v1/models", headers={"Authorization": authorization}),
                     parse=False)[0] == status, authorization
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong-key", max_retries=0).models.list()


def test_health_answers_503_with_the_reason_while_the_llms_ranks_are_down(server, client, monkeypatch):
    base_url, llm = server
    down = "the tensor-parallel group is down: tensor-parallel rank 1 exited with status 1"
    monkeypatch.setattr(llm, "ranks", SimpleNamespace(failure=down))  # what Ranks.take_down leaves on rank 0
    status, body = get(f"{base_url}/health", key=None)
    assert status == 503 and json.loads(body) == {"status": down}
    with pytest.raises(openai.InternalServerError, match=down):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    monkeypatch.undo()
    assert get(f"{base_url}/health", key=None) == (200, '{"status":"ok"}')


def test_engine_abort_frees_the_blocks_of_running_and_waiting_requests(reference):
    engine = reference.engine
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    alone = reference.generate("the survivor", params, use_tqdm=False)[0]
    free = engine.block_manager.num_free_blocks
    survivor = engine.add_request(1000, "the survivor", params)
    aborted = engine.add_request(1001, "a request aborted while running" * 3, params)
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_free_blocks < free
    held_by_survivor = len(engine.sequences[survivor.request_id].block_table)
    engine.abort([aborted.request_id])
    assert engine.block_manager.num_free_blocks == free - held_by_survivor
    assert aborted.request_id not in engine.sequences and aborted.request_id not in engine.outputs
    assert len(engine.scheduler.running) == 1
    while engine.has_unfinished():
        engine.step()
    assert survivor.token_ids == alone.token_ids
    assert engine.block_manager.num_free_blocks == free


@contextlib.contextmanager
def zoo_serve(checkpoint: Path):
    """``zoo serve`` in a process of its own, once it answers /health; yields (process, its client)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", str(checkpoint), "--port", str(port),
                                "--served-model-name", MODEL, "--device", "cpu"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "zoo serve did not start"
            try:
                if get(f"http://127.0.0.1:{port}/health", key=None)[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        yield process, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_zoo_serve_finishes_running_requests_and_exits_0_on_sigterm(checkpoint):
    with zoo_serve(checkpoint) as (process, client):
        stream = client.completions.create(model=MODEL, prompt="Before the signal", max_tokens=60, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        process.send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert chunks[-1].usage.completion_tokens == 60  # finished, not cut
        assert process.wait(timeout=60) == 0
    log = process.stdout.read()
    assert "Shutting down" in log and "Traceback" not in log


def test_requests_running_at_the_end_of_the_shutdown_grace_end_with_an_error_not_a_cut(checkpoint):
    llm = LLM(str(checkpoint), device="cpu")
    step = llm.engine.step
    # 1000 tokens of the tiny model outlast the grace however fast the machine: 10 ms a step at least
    llm.engine.step = lambda: time.sleep(0.01) or step()
    with ThreadPoolExecutor(2) as pool:
        with serving(llm, shutdown_grace_s=2) as base_url:
            client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
            stream = client.completions.create(model=MODEL, prompt="A long story:", max_tokens=1000, stream=True,
                                               extra_body={"ignore_eos": True})
            next(iter(stream))
            streamed = pool.submit(list, stream)
            whole = pool.submit(client.completions.create, model=MODEL, prompt="Another:", max_tokens=1000,
                                extra_body={"ignore_eos": True})
            time.sleep(0.5)  # the whole answer's request is running as the shutdown begins
        with pytest.raises(openai.APIError, match="the server is shutting down"):
            streamed.result(timeout=30)
        with pytest.raises(openai.InternalServerError, match="the server is shutting down"):
            whole.result(timeout=30)


def test_a_second_ctrl_c_ends_zoo_serve_at_once_with_status_0(checkpoint):
    with zoo_serve(checkpoint) as (process, client):
        stream = client.completions.create(model=MODEL, prompt="Before the signals", max_tokens=1000, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        process.send_signal(signal.SIGINT)
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)  # uvicorn forces its exit, skipping the app's shutdown
        assert process.wait(timeout=30) == 0
    log = process.stdout.read()
    assert "Fatal Python error" not in log, log  # uvicorn logs the tasks its forced exit cancels


def test_a_request_or_step_the_engine_fails_on_fails_alone_and_the_loop_carries_on(server, client, monkeypatch):
    base_url, llm = server
    engine = llm.engine
    prepare_prompt, add_request, step = engine.prepare_prompt, engine.add_request, engine.step

    def prepare_prompt_failing(prompt):  # in a prompt thread
        if prompt == "poison":
            raise RuntimeError("the tokenizer broke")
        return prepare_prompt(prompt)

    def add_request_failing(request_id, prompt, params):  # in the engine thread
        if prompt.text == "venom":
            raise RuntimeError("the scheduler broke")
        return add_request(request_id, prompt, params)

    failed_steps = []

    def step_failing_once():
        if not failed_steps:
            failed_steps.append(True)
            raise RuntimeError("a simulated device fault")
        return step()

    monkeypatch.setattr(engine, "prepare_prompt", prepare_prompt_failing)
    monkeypatch.setattr(engine, "add_request", add_request_failing)
    with pytest.raises(openai.InternalServerError, match="the tokenizer broke"):
        client.completions.create(model=MODEL, prompt="poison", max_tokens=4)
    with pytest.raises(openai.InternalServerError, match="the scheduler broke"):
        client.completions.create(model=MODEL, prompt="venom", max_tokens=4)
    monkeypatch.setattr(engine, "step", step_failing_once)
    with pytest.raises(openai.APIError, match="a simulated device fault"):
        list(client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True))
    assert failed_steps
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 4
    assert metric(base_url, "zoo:kv_cache_usage_perc") == 0
    assert get(f"{base_url}/health", key=None)[0] == 200


def test_a_prompt_being_tokenized_holds_up_no_running_request(server, client, monkeypatch):
    # A long prompt takes seconds to tokenize (a 6 MB text: ~5 s with SmolLM2's tokenizer). Its
    # prompt is prepared in a thread of its own: here it waits until the running stream has gained
    # tokens, which it could not do if the engine's thread were the one tokenizing.
    engine = server[1].engine
    prepare_prompt, tokenizing, streamed = engine.prepare_prompt, threading.Event(), threading.Event()
    prepared = []

    def slow_prepare_prompt(prompt):
        if prompt == "long":
            tokenizing.set()
            assert streamed.wait(timeout=60), "the stream gained no tokens while the prompt was tokenized"
        prepared.append(prompt)
        return prepare_prompt(prompt)

    monkeypatch.setattr(engine, "prepare_prompt", slow_prepare_prompt)
    stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=64, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(client.completions.create, model=MODEL, prompt="long", max_tokens=4, n=3,
                           extra_body={"ignore_eos": True})
        assert tokenizing.wait(timeout=60)
        gained = [next(chunks) for _ in range(8)]
        streamed.set()
        answer = long.result(timeout=60)
    assert [chunk.choices[0].finish_reason for chunk in gained] == [None] * 8  # each a step's delta
    assert [choice.finish_reason for choice in answer.choices] == ["length"] * 3
    assert answer.usage.completion_tokens == 12
    assert prepared.count("long") == 1  # once for its three choices
    stream.close()


@pytest.mark.gpu
def test_on_cuda_the_engine_thread_serves_what_llm_generate_gives(checkpoint):
    """The engine steps (CUDA graphs, Triton kernels) in the server's thread, not the caller's."""
    served = LLM(str(checkpoint), device="cuda", dtype="float32")
    reference = LLM(str(checkpoint), device="cuda", dtype="float32")
    prompts = [f"Request {i}: " + "abc"[i % 3] * i for i in range(16)]
    expected = reference.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                                  use_tqdm=False)
    with serving(served) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)

        def stream(prompt: str) -> str:
            chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0,
                                               stream=True, extra_body={"ignore_eos": True})
            return "".join(c.choices[0].text for c in chunks)

        with ThreadPoolExecutor(16) as pool:
            assert list(pool.map(stream, prompts)) == [o.text for o in expected]


def test_the_readmes_openai_example_runs_against_the_server(server, reference, capsys):
    """The README's openai client example as pasted, but for this server's address, model and key: it
    prints the streamed chat answer, then the greedy completion the model gives the prompt."""
    from tests.test_readme import snippet

    code = snippet("from openai import OpenAI").replace("http://127.0.0.1:8000/v1", f"{server[0]}/v1")
    code = code.replace('"SmolLM2-135M-Instruct"', repr(MODEL)).replace('api_key="unused"', f"api_key={KEY!r}")
    exec(code, {})  # noqa: S102 (the README's own code)
    completion = reference.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0),
                                    use_tqdm=False)[0]
    assert completion.error is None and completion.text
    # The streamed answer before it is sampled (a failed stream raises in the client).
    assert capsys.readouterr().out.endswith("\n" + completion.text + "\n")


def png_header(width: int, height: int) -> bytes:
    """A PNG's signature, header and end, no pixels: what PIL reads to learn an image's size."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)) + chunk(b"IEND", b"")


BAD_IMAGE_URLS = {  # name: (url, words the message must contain)
    "unreadable": ("data:image/png;base64,AAAA", "cannot be read"),
    "from the web": ("https://example.com/cat.png", "zoo fetches no URLs"),
    # 20,000 x 10,000 pixels: PIL refuses to decode it (a decompression bomb), a 400 not a 500.
    "decompression bomb": ("data:image/png;base64," + base64.b64encode(png_header(20_000, 10_000)).decode(),
                           "exceeds limit"),
}


def test_image_content_parts_answer_as_llm_chat_does_and_bad_images_are_named(tmp_path):
    """A LLaVA checkpoint served: a chat message's image as a data URL gives LLM.chat's greedy answer."""
    import io

    from tests.runtime.test_llava_runtime import image, make_llava

    path = make_llava(tmp_path / "llava")[0]
    llm = LLM(str(path), device="cpu", block_size=4)
    picture = image(2)
    png = io.BytesIO()
    picture.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = llm.chat([{"role": "user", "content": [{"type": "image", "image": picture},
                                                      {"type": "text", "text": "What is shown?"}]}], params,
                        use_tqdm=False)[0]
    assert expected.error is None
    with serving(llm) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
        answer = client.chat.completions.create(
            model=MODEL, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "What is shown?"}]}])
        for name, (bad_url, words) in BAD_IMAGE_URLS.items():
            status, body = post(f"{base_url}/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": bad_url}}]}]})
            assert status == 400, (name, body)
            assert body["error"]["param"] == "messages[0].content[1].image_url.url", name
            assert words in body["error"]["message"], (name, body)
    assert answer.choices[0].message.content == expected.text
    assert answer.usage.completion_tokens == 6
