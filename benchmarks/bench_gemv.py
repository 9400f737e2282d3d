"""Batch-1 decode's matrix-vector products on the Llama-3.1-8B shape: cuBLAS (``F.linear``)
against Triton GEMV kernels, as the weight-read bandwidth each reaches.

Each shape runs as 32 products on 32 different weights captured in one CUDA graph, like a decode
step's layers: the weights stream from HBM (not L2) and launch gaps count as they do in a step.

    python3 benchmarks/bench_gemv.py
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import hbm_bandwidth  # noqa: E402

LAYERS = 32
SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # BLOCK_N weight rows per program, multiplied elementwise and summed at the end.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], eviction_policy="evict_first")
        x = tl.load(x_ptr + cols)
        acc += w.to(tl.float32) * x[None, :].to(tl.float32)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty))


@triton.jit
def _gemv_dot_kernel(x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # The vector padded to 16 rows so each tile is one tensor-core dot; loads pipelined by stages.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, 16)
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * 0 + cols[None, :], mask=m[:, None] == 0, other=0.0)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], eviction_policy="evict_first")
        acc = tl.dot(x, tl.trans(w), acc)
    out = tl.sum(acc, axis=0)  # only row 0 is not zero
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty))


VARIANTS = {
    "rows 8x512 w4": (_gemv_rows_kernel, 8, 512, 4, 1),
    "rows 16x256 w4": (_gemv_rows_kernel, 16, 256, 4, 1),
    "rows 16x512 w8": (_gemv_rows_kernel, 16, 512, 8, 1),
    "rows 32x256 w8 s3": (_gemv_rows_kernel, 32, 256, 8, 3),
    "dot 32x128 s4": (_gemv_dot_kernel, 32, 128, 4, 4),
    "dot 64x128 s4": (_gemv_dot_kernel, 64, 128, 4, 4),
    "dot 16x256 s3": (_gemv_dot_kernel, 16, 256, 4, 3),
}


def triton_gemv(variant):
    kernel, block_n, block_k, warps, stages = VARIANTS[variant]

    def gemv(x, w, out):
        n, k = w.shape
        kernel[(n // block_n,)](x, w, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)

    return gemv


def graph_time_us(step) -> float:
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main():
    bandwidth = hbm_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + write)")
    print("| shape | N x K | implementation | µs per product | weight read TB/s | max rel err |")
    print("|---|---|---|---:|---:|---:|")
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(LAYERS)]
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        exact = F.linear(x.float(), weights[0].float())
        implementations = {"cuBLAS F.linear": lambda x, w, out: torch.mm(x, w.t(), out=out)}
        implementations.update({f"triton {v}": triton_gemv(v) for v in VARIANTS})
        for label, gemv in implementations.items():
            gemv(x, weights[0], out)
            error = ((out.float() - exact).abs().max() / exact.abs().max()).item()
            us = graph_time_us(lambda: [gemv(x, w, out) for w in weights]) / LAYERS
            print(f"| {name} | {n} x {k} | {label} | {us:.1f} | {n * k * 2 / us / 1e6:.2f} | {error:.1e} |", flush=True)
        del weights


if __name__ == "__main__":
    main()
