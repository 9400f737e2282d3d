"""The products of a SmolLM2 decode step on this CPU: F.linear vs weights laid out once
(``PackedWeight``: float32 a row-major copy multiplied as W x^T, bfloat16 packed by oneDNN).

SmolLM2-135M's 30 layers have four products each (qkv 576->960, o 576->576, gate-up 576->3072,
down 1536->576), then the LM head (576->49152, the tied embedding): ~538 MB of float32 weights,
more than the caches hold. This times one pass over all 121 at several row counts (the sequences
of a decode step), through ``F.linear`` on the weights as zoo lays them out (the layers'
column-major, the head's row-major) and through ``ops_cuda.linear.PackedWeight`` as the runtime
lays them out (it takes them for up to 16 rows). Medians of --repeats passes; the weights are
random.

    .venv/bin/python benchmarks/bench_cpu_linear.py [--dtype bfloat16]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ops_cuda.linear import PackedWeight  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # [out, in]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,24,32,48,64")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    torch.manual_seed(0)
    # Column-major, as zoo's loader lays out CPU weights.
    dtype = getattr(torch, args.dtype)
    weights = [torch.randn(inp, out, dtype=dtype).t() for _ in range(LAYERS) for out, inp in SHAPES]
    weights.append(torch.randn(VOCAB, HIDDEN, dtype=dtype))
    packs = [PackedWeight(w) for w in weights]
    megabytes = sum(w.numel() * w.element_size() for w in weights) / 1e6

    def one_pass(inputs, packed: bool) -> float:
        start = time.perf_counter()
        for weight, pack in zip(weights, packs):
            x = inputs[weight.shape[1]]
            pack.linear(x, weight, None) if packed else F.linear(x, weight)
        return (time.perf_counter() - start) * 1e3

    print(f"{len(weights)} {args.dtype} products of SmolLM2's shapes ({megabytes:.0f} MB of weights), "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; ms per pass, median of {args.repeats}")
    print("| rows | F.linear | PackedWeight | speed-up |")
    print("|---:|---:|---:|---:|")
    for rows in map(int, args.rows.split(",")):
        inputs = {HIDDEN: torch.randn(rows, HIDDEN, dtype=dtype), INTERMEDIATE: torch.randn(rows, INTERMEDIATE, dtype=dtype)}
        times = {}
        for packed in (False, True):
            one_pass(inputs, packed)  # warm-up
            times[packed] = statistics.median(one_pass(inputs, packed) for _ in range(args.repeats))
        print(f"| {rows} | {times[False]:.1f} | {times[True]:.1f} | {times[False] / times[True]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
