"""The products of a SmolLM2 decode step on this CPU: F.linear vs zoo's ``ops_cuda.linear.linear``
(float32 multiplied as W x^T, bfloat16 by weights packed once by oneDNN, both up to 16 rows).

SmolLM2-135M's 30 layers have four products each (qkv 576->960, o 576->576, gate-up 576->3072,
down 1536->576), then the LM head (576->49152, the tied embedding): ~538 MB of float32 weights,
more than the caches hold. This times one pass over all 121 at several row counts (the sequences
of a decode step), through ``F.linear`` and through zoo's ``linear`` as the runtime calls it (with
the ``PackedWeight`` it makes for bfloat16 weights), on the weights laid out as zoo loads them
(row-major). Medians of --repeats passes of each, alternating; the weights are random.

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

from ops_cuda.linear import PackedWeight, linear  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # [out, in]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,12,16,24,32")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    weights = [torch.randn(out, inp, dtype=dtype) for _ in range(LAYERS) for out, inp in SHAPES]
    weights.append(torch.randn(VOCAB, HIDDEN, dtype=dtype))
    packs = [PackedWeight(w) if PackedWeight.supports(w) else None for w in weights]
    megabytes = sum(w.numel() * w.element_size() for w in weights) / 1e6

    def one_pass(inputs, zoo: bool) -> float:
        start = time.perf_counter()
        for weight, pack in zip(weights, packs):
            x = inputs[weight.shape[1]]
            linear(x, weight, None, pack) if zoo else F.linear(x, weight)
        return (time.perf_counter() - start) * 1e3

    print(f"{len(weights)} {args.dtype} products of SmolLM2's shapes ({megabytes:.0f} MB of weights), "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; ms per pass, median of {args.repeats}")
    print("| rows | F.linear | zoo's linear | speed-up |")
    print("|---:|---:|---:|---:|")
    for rows in map(int, args.rows.split(",")):
        inputs = {HIDDEN: torch.randn(rows, HIDDEN, dtype=dtype), INTERMEDIATE: torch.randn(rows, INTERMEDIATE, dtype=dtype)}
        one_pass(inputs, False), one_pass(inputs, True)  # warm-up
        passes = [(one_pass(inputs, False), one_pass(inputs, True)) for _ in range(args.repeats)]  # alternating
        times = {zoo: statistics.median(p[zoo] for p in passes) for zoo in (False, True)}
        print(f"| {rows} | {times[False]:.1f} | {times[True]:.1f} | {times[False] / times[True]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
