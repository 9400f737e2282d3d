"""Where a batch-1 decode step's time goes on the GPU: the kernels of the captured graph, summed by
name over the steps of one generation, next to the wall-clock time per step.

Llama-3.1-8B shape, random bf16 weights, 128-token prompt, greedy, EOS ignored. On Hopper the
decode chain's Triton kernels use programmatic dependent launch: each starts while the previous
one still runs and waits inside, so their times here include those waits and overlap.

    python3 benchmarks/profile_decode.py                 # 64 decode steps
    python3 benchmarks/profile_decode.py --steps 128
"""

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import LLAMA_8B, hbm_bandwidth, random_hf  # noqa: E402
from loaders.in_memory import model_from_hf  # noqa: E402
from ops_cuda.triton_helpers import pdl  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402


HOST_GAP_US = 10


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()

    model = model_from_hf(random_hf(LLAMA_8B))
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    bandwidth = hbm_bandwidth()
    llm = LLM(model, max_num_seqs=1, max_model_len=1024, enable_prefix_caching=False)
    prompt = torch.randint(0, LLAMA_8B["vocab_size"], (128,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up

    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], params, use_tqdm=False)
        torch.cuda.synchronize()
    kernels = defaultdict(lambda: [0.0, 0])
    intervals = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels[event.name[:90]]
            entry[0] += event.time_range.elapsed_us()
            entry[1] += 1
            intervals.append((event.time_range.start, event.time_range.end))
    # Idle time between consecutive GPU activities: short gaps are the launch gaps inside a graph,
    # long ones the device waiting on the host.
    intervals.sort()
    gaps, busy_until = [], intervals[0][1]
    for start, end in intervals[1:]:
        gaps.append(max(0.0, start - busy_until))
        busy_until = max(busy_until, end)
    tokens = args.steps + 1
    short = sum(g for g in gaps if g < HOST_GAP_US)
    long = [g for g in gaps if g >= HOST_GAP_US]
    print(f"GPU idle per token: {short / tokens:.1f} µs in gaps under {HOST_GAP_US} µs (between kernels), "
          f"{sum(long) / tokens:.1f} µs in {len(long)} longer gaps (waiting on the host)")
    gpu_us = sum(total for total, _ in kernels.values())
    roofline_ms = weight_bytes / bandwidth * 1e3
    print(f"{args.steps + 1} tokens (one prefill): {wall_ms / (args.steps + 1):.3f} ms/token wall; "
          f"GPU busy {gpu_us / 1e3 / (args.steps + 1):.3f} ms/token; roofline {roofline_ms:.3f} ms "
          f"({weight_bytes / 1e9:.2f} GB at {bandwidth / 1e12:.2f} TB/s)")
    if pdl(next(model.parameters())):
        print("programmatic dependent launch is on: Triton kernels' times include their wait for the kernel before")
    print("| kernel | µs per token | calls per token | share |")
    print("|---|---:|---:|---:|")
    for name, (total, calls) in sorted(kernels.items(), key=lambda item: -item[1][0])[:25]:
        print(f"| {name} | {total / (args.steps + 1):.1f} | {calls / (args.steps + 1):.1f} | {total / gpu_us:.1%} |")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
