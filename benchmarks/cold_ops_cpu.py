"""What a small op costs on this CPU alone and right after a matrix product, as in a decode step.

A SmolLM2 decode step of 16 sequences interleaves ~120 float32 products, each streaming a few MB of
weights, with ~10 small ops a layer (norms, rotary, KV write, activation, attention's gathers).
Timed alone in a loop, such an op takes tens of µs; inside the step it takes several times more.
This times zoo's fused residual-add + RMSNorm on [16, 576] both ways: in a loop of its own, and
each call right after a [16, 576] x [576, 3072] product on one of 40 distinct weights (~280 MB,
more than fits in the caches, as a model's layers are). The medians of --repeats runs of --calls.

    .venv/bin/python benchmarks/cold_ops_cpu.py
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ops_cuda import fused_add_rms_norm  # noqa: E402
from ops_cuda.linear import linear  # noqa: E402

TOKENS, HIDDEN, INTERMEDIATE, WEIGHTS = 16, 576, 3072, 40


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    x, residual, weight = torch.randn(TOKENS, HIDDEN), torch.randn(TOKENS, HIDDEN), torch.randn(HIDDEN)
    weights = [torch.randn(INTERMEDIATE, HIDDEN) for _ in range(WEIGHTS)]

    def alone() -> float:
        start = time.perf_counter()
        for _ in range(args.calls):
            fused_add_rms_norm(x, residual, weight, 1e-5)
        return (time.perf_counter() - start) / args.calls

    def after_product() -> float:
        spent = 0.0
        for i in range(args.calls):
            linear(x, weights[i % WEIGHTS])  # as a decode step multiplies (W x^T in float32)
            start = time.perf_counter()
            fused_add_rms_norm(x, residual, weight, 1e-5)
            spent += time.perf_counter() - start
        return spent / args.calls

    alone(), after_product()  # warm-up
    runs = [(alone(), after_product()) for _ in range(args.repeats)]
    alone_us = statistics.median(a for a, _ in runs) * 1e6
    after_us = statistics.median(b for _, b in runs) * 1e6
    print(f"fused add + RMSNorm [{TOKENS}, {HIDDEN}] float32, {torch.get_num_threads()} threads: "
          f"{alone_us:.1f} µs alone, {after_us:.1f} µs right after a [{TOKENS}, {HIDDEN}] x [{HIDDEN}, {INTERMEDIATE}] "
          f"product ({after_us / alone_us:.1f}x)")


if __name__ == "__main__":
    main()
