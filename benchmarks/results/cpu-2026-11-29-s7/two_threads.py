"""Probe, seventh session: can the two cores each run half of a decode step?

A decode step runs its small ops (norms, rotary, attention, ...) on one core while the other
waits. Here the 16 decoding sequences of SmolLM2 (float32) split into two halves of 8, each a
forward of its own on its own Python thread, with one MKL thread each; alternating step by step
in one process with the usual step (all 16 in one forward, two MKL threads) and with the usual
step on one thread. Then the cause, in isolation: 20,000 small adds run on one thread, and the
same work split over two threads.

    .venv/bin/python benchmarks/results/cpu-2026-11-29-s7/two_threads.py
"""

import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import runtime.model_runner as model_runner  # noqa: E402
from benchmarks.bench_generate import TOPICS  # noqa: E402
from loaders.default_model import default_model_path  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402

one_forward = model_runner.ModelRunner.run
other_thread = ThreadPoolExecutor(1)


def forward(runner, scheduled):
    with torch.inference_mode():  # inference mode is per thread
        step = model_runner.StepInputs(scheduled, runner.block_tables, runner.kv_cache.block_size, runner.sampled_rows)
        input_ids, sources, positions, metadata, logits_rows = step.to_device(runner.device, runner.staging)
        input_ids = model_runner.fill_pending(input_ids, sources, runner.sampled_ids)
        return runner.model(input_ids, positions, metadata, logits_indices=logits_rows), step.sampled


def two_forwards(runner, scheduled):
    if len(scheduled) < 2 or any(count != 1 for _, count in scheduled):
        return one_forward(runner, scheduled)
    half = len(scheduled) // 2
    second = other_thread.submit(forward, runner, scheduled[half:])
    logits, sampled = forward(runner, scheduled[:half])
    more_logits, more_sampled = second.result()
    return torch.cat([logits, more_logits]), sampled + more_sampled


def small_adds(count):
    x = torch.randn(8, 576)
    for _ in range(count):
        torch.add(x, x)


def main():
    variants = {"one forward, 2 MKL threads": (one_forward, 2), "two half forwards on two threads": (two_forwards, 1),
                "one forward, 1 MKL thread": (one_forward, 1)}
    llm = LLM(str(default_model_path()), dtype="float32", device="cpu", max_model_len=512, enable_prefix_caching=False)
    chats = [llm.chat_prompt([{"role": "user", "content": f"Write a short poem about {TOPICS[i]}."}]) for i in range(16)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    times = {name: [] for name in variants}
    for round_ in range(2):
        for i, prompt in enumerate(chats):
            engine.add_request(round_ * 100 + i, prompt, params)
        engine.step()  # the prefills
        n = 0
        while engine.has_unfinished():
            name = list(variants)[n % len(variants)]
            n += 1
            model_runner.ModelRunner.run, threads = variants[name]
            torch.set_num_threads(threads)
            start = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - start)
    for name, spent in times.items():
        print(f"{name}: median decode step {statistics.median(spent) * 1e3:.1f} ms over {len(spent)} steps")

    torch.set_num_threads(1)
    start = time.perf_counter()
    small_adds(20_000)
    alone = time.perf_counter() - start
    helper = threading.Thread(target=small_adds, args=(10_000,))
    start = time.perf_counter()
    helper.start()
    small_adds(10_000)
    helper.join()
    print(f"20,000 adds of [8, 576]: {alone * 1e3:.0f} ms on one thread, {(time.perf_counter() - start) * 1e3:.0f} ms "
          "split over two (each op takes and gives back the GIL)")


if __name__ == "__main__":
    main()
