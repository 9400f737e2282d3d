"""Where a batch-1 decode step's time goes on the GPU: the kernels of the captured graph, summed by
name over the steps of one generation, next to the wall-clock time per step.

Random bf16 weights of one of three shapes (--shape): Llama-3.1-8B (the default), Qwen3-30B-A3B (48
MoE layers, 128 experts, top-8) or DeepSeek-V3 with 3 layers (1 dense, 2 MoE: 256 experts in 8 groups,
top-8, a shared expert), the last also with its decoder's linear weights block-quantised to FP8
(``deepseek-v3-3layer-fp8``, written and loaded as DeepSeek's checkpoints are, as
``bench_deepseek.py`` does); 128-token prompt, greedy, EOS ignored. The roofline counts the weight bytes a
decode step reads (the picked experts only). On Hopper the decode chain's Triton kernels use
programmatic dependent launch: each starts while the previous one still runs and waits inside, so
their times here include those waits and overlap.

The wall time per step is taken as ``bench_gpu.py --task decode`` takes it, over 256 new tokens with
the time of a one-token generation taken off, whatever --steps is: that one-token time varies by
several ms from call to call, more than a few steps take. Beside it the captured one-row graph is
replayed back to back on the inputs that generation left: the step's GPU time with no host in the
loop. A wall time at that figure means the host's work per step is hidden (run-ahead); above it, the
host holds the GPU up.

--without-pdl turns programmatic dependent launch off: each kernel's time is then its own and the
table adds up to the GPU's busy time, at the cost of the starts PDL hides.

--baseline profiles the same model twice, first with the MoE decode paths off (zoo::moe_experts's
decode kernel, DECODE_MAX_PAIRS = 0, and zoo::route_topk's Triton kernel: the PyTorch router), then on:
the before and after of one run.

    python3 benchmarks/profile_decode.py                 # 64 decode steps, Llama-3.1-8B shape
    python3 benchmarks/profile_decode.py --steps 128
    python3 benchmarks/profile_decode.py --without-pdl
    python3 benchmarks/profile_decode.py --shape qwen3-30b-a3b --baseline
    python3 benchmarks/profile_decode.py --shape deepseek-v3-3layer --baseline
    python3 benchmarks/profile_decode.py --shape deepseek-v3-3layer-fp8
"""

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_deepseek  # noqa: E402
import bench_moe  # noqa: E402
import ops_cuda.moe  # noqa: E402
import ops_cuda.router  # noqa: E402
import ops_cuda.triton_helpers  # noqa: E402
from bench_gpu import LLAMA_8B, decode_ms_per_token, hbm_bandwidth, random_hf  # noqa: E402
from models import AutoModelForCausalLM  # noqa: E402
from ops_cuda.triton_helpers import pdl  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402

DECODE_MAX_PAIRS = ops_cuda.moe.DECODE_MAX_PAIRS


def llama_8b():
    model = AutoModelForCausalLM.from_hf(random_hf(LLAMA_8B))
    return model, sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)


def qwen3_30b_a3b():
    model = bench_moe.zoo_from_random_hf("qwen3-30b-a3b")
    return model, bench_moe.active_weight_bytes(model)[0]


def deepseek_v3_3layer():
    reference = bench_deepseek.random_hf(3)
    model = bench_moe.zoo_copy_of(reference)  # through host memory on an 80 GB GPU, as bench_deepseek.py builds it
    del reference
    return model, bench_deepseek.active_weight_bytes(model)


def deepseek_v3_3layer_fp8():
    reference = bench_deepseek.random_hf(3)
    with tempfile.TemporaryDirectory() as checkpoint:  # block-quantised as DeepSeek's checkpoints are
        bench_deepseek.write_fp8_checkpoint(reference, Path(checkpoint))
        del reference
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device="cuda")
    return model, bench_deepseek.active_weight_bytes(model)


SHAPES = {"llama-8b": llama_8b, "qwen3-30b-a3b": qwen3_30b_a3b, "deepseek-v3-3layer": deepseek_v3_3layer,
          "deepseek-v3-3layer-fp8": deepseek_v3_3layer_fp8}


def use_moe_decode_paths(enabled: bool) -> None:
    """The MoE decode kernel and the router kernel on (the defaults) or off (the paths before them)."""
    ops_cuda.moe.DECODE_MAX_PAIRS = DECODE_MAX_PAIRS if enabled else 0
    ops_cuda.router.ROUTER_KERNEL = enabled


HOST_GAP_US = 10
WALL_TOKENS = 256
GRAPH_REPLAYS = 200


def graph_replay_ms(llm) -> float:
    """The one-row decode graph replayed back to back, on the inputs its last step left, in ms per replay."""
    graph = llm.engine.runner.graphs.graphs[1]
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(GRAPH_REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / GRAPH_REPLAYS


def profile_decode(model, weight_bytes: int, bandwidth: float, steps: int, label: str) -> None:
    llm = LLM(model, max_num_seqs=1, max_model_len=1024, enable_prefix_caching=False)
    vocab_size = model.config.vocab_size
    prompt = torch.randint(0, vocab_size, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    # The decode steps' wall time, the prefill taken off (its first, untimed generation warms up).
    step_ms = decode_ms_per_token(llm, prompt, WALL_TOKENS)
    replay_ms = graph_replay_ms(llm)

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True), use_tqdm=False)
        torch.cuda.synchronize()
    del llm
    bench_moe.free_memory()
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
    tokens = steps + 1
    print(f"\n## {label}\n")
    short = sum(g for g in gaps if g < HOST_GAP_US)
    long = [g for g in gaps if g >= HOST_GAP_US]
    print(f"GPU idle per token: {short / tokens:.1f} µs in gaps under {HOST_GAP_US} µs (between kernels), "
          f"{sum(long) / tokens:.1f} µs in {len(long)} longer gaps (waiting on the host)")
    gpu_us = sum(total for total, _ in kernels.values())
    roofline_ms = weight_bytes / bandwidth * 1e3
    print(f"unprofiled: {step_ms:.3f} ms per decode step (wall); {replay_ms:.3f} ms replaying the one-row graph "
          f"back to back (no host in the loop); roofline {roofline_ms:.3f} ms ({weight_bytes / 1e9:.2f} GB at "
          f"{bandwidth / 1e12:.2f} TB/s), {roofline_ms / step_ms:.0%} of the wall time")
    print(f"profiled, {tokens} tokens (one prefill): GPU busy {gpu_us / 1e3 / tokens:.3f} ms/token")
    if pdl(next(model.parameters())):
        print("programmatic dependent launch is on: Triton kernels' times include their wait for the kernel before")
    else:
        print("programmatic dependent launch is off: each kernel's time is its own")
    print("| kernel | µs per token | calls per token | share |")
    print("|---|---:|---:|---:|")
    for name, (total, calls) in sorted(kernels.items(), key=lambda item: -item[1][0])[:25]:
        print(f"| {name} | {total / tokens:.1f} | {calls / tokens:.1f} | {total / gpu_us:.1%} |")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    parser.add_argument("--baseline", action="store_true",
                        help="profile with the MoE decode kernel and the router kernel off first, then on")
    parser.add_argument("--without-pdl", action="store_true",
                        help="programmatic dependent launch off, so that the kernels' times add up")
    args = parser.parse_args()
    ops_cuda.triton_helpers.PDL_ENABLED = not args.without_pdl

    model, weight_bytes = SHAPES[args.shape]()
    bench_moe.free_memory()
    bandwidth = hbm_bandwidth()
    runs = [("baseline: MoE decode kernel and router kernel off", False),
            ("MoE decode kernel and router kernel on (the defaults)", True)] if args.baseline else [("the defaults", True)]
    for label, enabled in runs:
        use_moe_decode_paths(enabled)
        profile_decode(model, weight_bytes, bandwidth, args.steps, f"{args.shape}, {label}")
    use_moe_decode_paths(True)


if __name__ == "__main__":
    main()
