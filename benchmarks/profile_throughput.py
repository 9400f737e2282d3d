"""Where the 8B 1000/1000 throughput run's time goes: the steps that carry prompt tokens, the
decode steps of every sequence and those of the tail (the sequences admitted first end first),
each with how many did not run ahead of the host; decode steps early, midway and late; the
kernels of a few decode steps midway and of two steps of the prefill phase; and the GPU's SM
clock and power through the run (``bench_gpu.gpu_clocks``).

Same workload as ``bench_gpu.py --task throughput-8b`` (Llama-3.1-8B shape, random bf16 weights,
as many 1000-token prompts as the KV cache holds at once, 1000 greedy tokens each, EOS ignored),
stepping the engine by hand and timing each step.

    python3 benchmarks/profile_throughput.py [--kv-cache-dtype fp8 --max-requests 1024]
"""

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import LLAMA_8B, clocks_text, gpu_clocks, workload, zoo_8b  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402


def kernel_table(prof, steps: int) -> None:
    """The 14 kernels of ``prof`` that took the GPU longest, per step of the ``steps`` profiled."""
    kernels = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:80]] += event.time_range.elapsed_us()
    total = sum(kernels.values())
    print(f"GPU busy {total / steps / 1e3:.2f} ms per step")
    print("| kernel | ms per step | share |")
    print("|---|---:|---:|")
    for name, us in sorted(kernels.items(), key=lambda item: -item[1])[:14]:
        print(f"| {name} | {us / steps / 1e3:.2f} | {us / total:.1%} |")


def step_through(engine, profile_steps: int):
    """Steps the engine until its requests are done, timing each step; profiles two steps of the
    prefill phase and ``profile_steps`` decode steps midway. Returns the steps, each (seconds,
    prompt tokens, decode rows, whether it ran ahead), and the two profiles."""
    steps, prof, prefill_prof = [], None, None
    last = time.perf_counter()
    while engine.has_unfinished():
        if prefill_prof is None and len(steps) == 20:
            with profile(activities=[ProfilerActivity.CUDA]) as prefill_prof:
                for _ in range(2):
                    engine.step()
                torch.cuda.synchronize()
            last = time.perf_counter()
            continue
        if prof is None and sum(1 for s in steps[-500:] if s[1] == 0) == 500:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(profile_steps):
                    engine.step()
                torch.cuda.synchronize()
            last = time.perf_counter()
            continue
        ahead = engine.run_ahead.num_steps_run_ahead
        engine.step()
        now = time.perf_counter()
        launched = engine.run_ahead.in_flight
        scheduled = launched.scheduled if launched is not None else []
        prompt_tokens = sum(count for _, count in scheduled if count > 1)
        decodes = sum(1 for _, count in scheduled if count == 1)
        steps.append((now - last, prompt_tokens, decodes, engine.run_ahead.num_steps_run_ahead > ahead))
        last = now
    torch.cuda.synchronize()
    return steps, prof, prefill_prof


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-requests", type=int, default=512)
    parser.add_argument("--profile-steps", type=int, default=4)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="fp8: an e4m3 KV cache, which holds about twice the requests")
    args = parser.parse_args()

    llm = LLM(zoo_8b(), max_num_seqs=args.max_requests, max_model_len=2048, max_num_batched_tokens=8192,
              kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    requests = min(args.max_requests, engine.block_manager.num_blocks // engine.block_manager.blocks_needed(2000))
    engine.scheduler.max_num_seqs = requests
    llm.generate(workload(4, 1000, 1000, LLAMA_8B["vocab_size"])[0], SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    llm.reset_prefix_cache()  # the warm-up's prompts are the timed run's first four
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(workload(requests, 1000, 1000, LLAMA_8B["vocab_size"])[0]):
        engine.add_request(10_000 + i, prompt, params)

    clocks = {}
    torch.cuda.synchronize()
    start = time.perf_counter()
    with gpu_clocks(clocks):
        steps, prof, prefill_prof = step_through(engine, args.profile_steps)
    total = time.perf_counter() - start
    tokens = requests * 1000
    print(f"{requests} requests x 1000 tokens: {total:.1f} s, {tokens / total:.0f} output tok/s "
          f"({engine.run_ahead.num_steps_run_ahead} steps run ahead)")
    print(f"GPU through the run: {clocks_text(clocks)}")
    phases = {"steps with prompt tokens": [s for s in steps if s[1] > 0],
              f"decode-only steps of all {requests} sequences": [s for s in steps if s[1] == 0 and s[2] == requests],
              "decode-only steps of fewer (the tail)": [s for s in steps if s[1] == 0 and s[2] < requests]}
    print("| steps | count | seconds | median ms | not run ahead | prompt tokens | decode rows |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, part in phases.items():
        if part:
            print(f"| {label} | {len(part)} | {sum(s[0] for s in part):.1f} | "
                  f"{statistics.median(s[0] for s in part) * 1e3:.1f} | {sum(not s[3] for s in part)} | "
                  f"{sum(s[1] for s in part)} | {sum(s[2] for s in part)} |")
    print(f"(the {2 + args.profile_steps} profiled steps not counted)")
    decode_steps = [s[0] for s in steps if s[1] == 0]
    for label, part in (("first 100", decode_steps[:100]), ("middle 100", decode_steps[450:550]),
                        ("last 100", decode_steps[-100:])):
        print(f"decode step, {label}: median {statistics.median(part) * 1e3:.2f} ms")
    print(f"\nkernels of {args.profile_steps} decode steps midway:")
    kernel_table(prof, args.profile_steps)
    print("\nkernels of 2 steps of the prefill phase (8192 tokens each, prompt chunks and decodes):")
    kernel_table(prefill_prof, 2)


if __name__ == "__main__":
    main()
