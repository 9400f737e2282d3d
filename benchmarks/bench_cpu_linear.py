"""The products of SmolLM2 steps on this CPU: F.linear vs zoo's ``ops_cuda.linear.linear``
(by weights packed once by oneDNN; one or two float32 rows as W x^T).

SmolLM2-135M's 30 layers have four products each (qkv 576->960, o 576->576, gate-up 576->3072,
down 1536->576), then the LM head (576->49152, the tied embedding): ~538 MB of float32 weights,
more than the caches hold. This times one pass over all 121 at several row counts (the sequences
of a decode step, the tokens of a prompt chunk), through ``F.linear`` and through zoo's ``linear``
as the runtime calls it (with the ``PackedWeight`` it makes for each weight), on the weights laid
out as zoo loads them (row-major), and in float32 up to 16 rows also as W x^T alone
(``transposed_linear``, what runs where no pack serves). Medians of --repeats passes of each,
alternating; the weights are random.

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

from ops_cuda.linear import FEW_ROWS, PackedWeight, linear, transposed_linear  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # [out, in]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    weights = [torch.randn(out, inp, dtype=dtype) for _ in range(LAYERS) for out, inp in SHAPES]
    weights.append(torch.randn(VOCAB, HIDDEN, dtype=dtype))
    packs = [PackedWeight(w) if PackedWeight.supports(w) else None for w in weights]
    megabytes = sum(w.numel() * w.element_size() for w in weights) / 1e6

    ways = {
        "F.linear": lambda x, weight, pack: F.linear(x, weight),
        "W x^T": lambda x, weight, pack: transposed_linear(x, weight, None),
        "zoo's linear": lambda x, weight, pack: linear(x, weight, None, pack),
    }

    def one_pass(inputs, way: str) -> float:
        start = time.perf_counter()
        for weight, pack in zip(weights, packs):
            ways[way](inputs[weight.shape[1]], weight, pack)
        return (time.perf_counter() - start) * 1e3

    print(f"{len(weights)} {args.dtype} products of SmolLM2's shapes ({megabytes:.0f} MB of weights), "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; ms per pass, median of {args.repeats}")
    print("| rows | F.linear | W x^T | zoo's linear | F.linear / zoo's |")
    print("|---:|---:|---:|---:|---:|")
    for rows in map(int, args.rows.split(",")):
        inputs = {HIDDEN: torch.randn(rows, HIDDEN, dtype=dtype), INTERMEDIATE: torch.randn(rows, INTERMEDIATE, dtype=dtype)}
        timed = [way for way in ways if way != "W x^T" or (dtype == torch.float32 and rows <= FEW_ROWS)]
        for way in timed:  # warm-up
            one_pass(inputs, way)
        passes = [{way: one_pass(inputs, way) for way in timed} for _ in range(args.repeats)]  # alternating
        times = {way: statistics.median(p[way] for p in passes) for way in timed}
        plain, zoo = times["F.linear"], times["zoo's linear"]
        transposed = f"{times['W x^T']:.1f}" if "W x^T" in times else "-"
        print(f"| {rows} | {plain:.1f} | {transposed} | {zoo:.1f} | {plain / zoo:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
