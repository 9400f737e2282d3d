"""Batch-1 decode's matrix-vector products on the Llama-3.1-8B shape: cuBLAS (``F.linear``)
against zoo::gemv's Triton kernel and a sweep of its tile sizes, as the weight-read bandwidth
each reaches; then the MLP's gate_up product with its SiLU: zoo::gated_gemv (one kernel) and a
sweep of its tiles against the launches it replaces, a product then act_and_mul.

Each shape runs as 32 products on 32 different weights captured in one CUDA graph, like a decode
step's layers: the weights stream from HBM (not L2) and launch gaps count as they do in a step.

    python3 benchmarks/bench_gemv.py                # both tables
    python3 benchmarks/bench_gemv.py --task gated   # the gated product's table only
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import graph_us, hbm_bandwidth  # noqa: E402
from ops_cuda import act_and_mul, gated_gemv, gemv  # noqa: E402
from ops_cuda.activation import act_and_mul_reference  # noqa: E402
from ops_cuda.triton_kernels import (  # noqa: E402
    GATED_GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_ROWS, GEMV_WARPS, gated_gemv_triton, gemv_kernel, gemv_launch, gemv_rows,
)

LAYERS = 32
SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336),
          "lm_head": (128256, 4096)}


# (BLOCK_N, BLOCK_K, warps) of ops_cuda.triton_kernels.gemv_kernel; zoo::gemv picks one of the first
# three by the weight's shape (gemv_rows).
CONFIGS = [*((rows, GEMV_BLOCK_K, GEMV_WARPS) for rows in GEMV_ROWS), (8, 512, 4), (4, 512, 2), (8, 256, 2),
           (16, 512, 8)]
# (columns of h, BLOCK_K, warps) of ops_cuda.triton_kernels.gated_gemv_kernel (twice as many weight rows per
# tile); the first is what zoo::gated_gemv runs.
GATED_CONFIGS = [(GATED_GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_WARPS), (1, 1024, 4), (4, 1024, 4), (4, 512, 4), (2, 512, 2),
                 (8, 512, 8), (1, 2048, 4)]


def sweep_gemv(block_n, block_k, warps):
    def gemv(x, w, out):
        args, options = gemv_launch(x, w, None, None)
        options.update(BLOCK_K=block_k, num_warps=warps)
        gemv_kernel[(w.shape[0] // block_n,)](*args, BLOCK_N=block_n, **options)
        return args[3]

    return gemv


def sweep_gated_gemv(block_n, block_k, warps):
    def gated(x, w):
        return gated_gemv_triton(x, w, None, "silu", block_n, block_k, warps)

    return gated


def products():
    print("| shape | N x K | implementation | µs per product | weight read TB/s | max rel err |")
    print("|---|---|---|---:|---:|---:|")
    for name, (n, k) in SHAPES.items():
        layers = LAYERS if name != "lm_head" else 4  # 1 GB each: past the L2 anyway
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(layers)]
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        exact = F.linear(x.float(), weights[0].float())
        rows = gemv_rows(*gemv_launch(x, weights[0], None, None))
        implementations = {"cuBLAS F.linear": lambda x, w, out: torch.mm(x, w.t(), out=out),
                           f"zoo::gemv ({rows} rows)": lambda x, w, out: gemv(x, w, None)}
        implementations.update({f"sweep {c[0]}x{c[1]} w{c[2]}": sweep_gemv(*c) for c in CONFIGS})
        for label, product in implementations.items():
            error = ((product(x, weights[0], out).float() - exact).abs().max() / exact.abs().max()).item()
            us = graph_us(lambda: [product(x, w, out) for w in weights]) / len(weights)
            print(f"| {name} | {n} x {k} | {label} | {us:.1f} | {n * k * 2 / us / 1e6:.2f} | {error:.1e} |", flush=True)


def gated_products():
    n, k = SHAPES["gate_up_proj"]
    print(f"\n| gate_up_proj + SiLU, {n} x {k} | µs per product | weight read TB/s | max rel err |")
    print("|---|---:|---:|---:|")
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(LAYERS)]
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    exact = act_and_mul_reference(F.linear(x.float(), weights[0].float()), "silu")
    implementations = {"cuBLAS F.linear, then act_and_mul": lambda x, w: act_and_mul(F.linear(x, w), "silu"),
                       "zoo::gemv, then act_and_mul": lambda x, w: act_and_mul(gemv(x, w, None), "silu"),
                       "zoo::gated_gemv": lambda x, w: gated_gemv(x, w, None, "silu")}
    implementations.update({f"gated sweep {c[0]} columns x {c[1]} w{c[2]}": sweep_gated_gemv(*c)
                            for c in GATED_CONFIGS})
    for label, product in implementations.items():
        error = ((product(x, weights[0]).float() - exact).abs().max() / exact.abs().max()).item()
        us = graph_us(lambda: [product(x, w) for w in weights]) / len(weights)
        print(f"| {label} | {us:.1f} | {n * k * 2 / us / 1e6:.2f} | {error:.1e} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="all", choices=["all", "gated"])
    args = parser.parse_args()
    bandwidth = hbm_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + write)")
    if args.task == "all":
        products()
    gated_products()


if __name__ == "__main__":
    main()
