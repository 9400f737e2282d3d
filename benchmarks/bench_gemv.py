"""Batch-1 decode's matrix-vector products on the Llama-3.1-8B shape: cuBLAS (``F.linear``)
against zoo::gemv's Triton kernel and a sweep of its tile sizes, as the weight-read bandwidth
each reaches; then the GEMV kernel's fused prologues against the separate launches they replace:
zoo::gated_gemv (down_proj reading gate_up's output) against zoo::act_and_mul then zoo::gemv, and
zoo::fused_add_rms_norm_gemv (qkv_proj and gate_up_proj reading their pre-norm's input) against
zoo::fused_add_rms_norm then zoo::gemv.

Each shape runs as 32 products on 32 different weights captured in one CUDA graph, like a decode
step's layers: the weights stream from HBM (not L2) and launch gaps count as they do in a step.

    python3 benchmarks/bench_gemv.py
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import graph_us, hbm_bandwidth  # noqa: E402
from ops_cuda import act_and_mul, fused_add_rms_norm, fused_add_rms_norm_gemv, gated_gemv, gemv  # noqa: E402
from ops_cuda.triton_helpers import pdl_launch  # noqa: E402
from ops_cuda.triton_kernels import GEMV_BLOCK_K, GEMV_BLOCK_N, GEMV_WARPS, gemv_kernel  # noqa: E402

LAYERS = 32
EPS = 1e-5
SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336),
          "lm_head": (128256, 4096)}


# (BLOCK_N, BLOCK_K, warps) of ops_cuda.triton_kernels.gemv_kernel; the first is what zoo::gemv runs.
CONFIGS = [(GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_WARPS), (4, 512, 2), (4, 1024, 4), (8, 1024, 4), (8, 256, 2),
           (16, 512, 8), (8, 512, 8)]


def sweep_gemv(block_n, block_k, warps):
    def product(x, w, out):
        n, k = w.shape
        gemv_kernel[(n // block_n,)](
            x, w, x, out, n, k, k, x, x, x, 0.0, HAS_BIAS=False, ACTIVATION="", NORM=False, WEIGHT_OFFSET=0.0,
            MULTIPLY_IN_FLOAT32=False, BLOCK_H=1, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **pdl_launch(x),
        )
        return out

    return product


def norm_prologue_at(warps):
    """zoo::fused_add_rms_norm_gemv's kernel (Llama's norm options) at ``warps`` warps."""
    def product(x, residual, norm_weight, w, summed):
        n, k = w.shape
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
        gemv_kernel[(n // GEMV_BLOCK_N,)](
            x, w, x, out, n, k, k, residual, norm_weight, summed, EPS, HAS_BIAS=False, ACTIVATION="", NORM=True,
            WEIGHT_OFFSET=0.0, MULTIPLY_IN_FLOAT32=False, BLOCK_H=k, BLOCK_N=GEMV_BLOCK_N, BLOCK_K=GEMV_BLOCK_K,
            num_warps=warps, **pdl_launch(x),
        )
        return out

    return product


def print_row(name, n, k, label, us, error):
    print(f"| {name} | {n} x {k} | {label} | {us:.1f} | {n * k * 2 / us / 1e6:.2f} | {error} |", flush=True)


def products():
    print("| shape | N x K | implementation | µs per product | weight read TB/s | max rel err |")
    print("|---|---|---|---:|---:|---:|")
    for name, (n, k) in SHAPES.items():
        layers = LAYERS if name != "lm_head" else 4  # 1 GB each: past the L2 anyway
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(layers)]
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        exact = F.linear(x.float(), weights[0].float())
        implementations = {"cuBLAS F.linear": lambda x, w, out: torch.mm(x, w.t(), out=out),
                           "zoo::gemv": lambda x, w, out: gemv(x, w, None)}
        implementations.update({f"sweep {c[0]}x{c[1]} w{c[2]}": sweep_gemv(*c) for c in CONFIGS})
        for label, product in implementations.items():
            error = ((product(x, weights[0], out).float() - exact).abs().max() / exact.abs().max()).item()
            us = graph_us(lambda: [product(x, w, out) for w in weights]) / len(weights)
            print_row(name, n, k, label, us, f"{error:.1e}")


def fused_prologues():
    """Each fused product against its separate launches, 32 layers' weights in one graph; the
    fused output compared bit for bit with the separate ops'."""
    print()
    print("| product | N x K | launches | µs per layer | weight read TB/s | bit-equal to separate |")
    print("|---|---|---|---:|---:|---|")
    n, k = SHAPES["down_proj"]
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(LAYERS)]
    gate_up = torch.randn(1, 2 * k, dtype=torch.bfloat16, device="cuda")
    separate = lambda w: gemv(act_and_mul(gate_up, "silu"), w, None)  # noqa: E731
    fused = lambda w: gated_gemv(gate_up, w, None, "silu")  # noqa: E731
    equal = "yes" if torch.equal(separate(weights[0]), fused(weights[0])) else "NO"
    for label, product in (("act_and_mul + zoo::gemv", separate), ("zoo::gated_gemv", fused)):
        print_row("down_proj", n, k, label, graph_us(lambda: [product(w) for w in weights]) / LAYERS, equal)
    del weights
    for name in ("qkv_proj", "gate_up_proj"):
        n, k = SHAPES[name]
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(LAYERS)]
        x, residual = (torch.randn(1, k, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        norm_weight = 1 + 0.1 * torch.randn(k, dtype=torch.bfloat16, device="cuda")
        summed = torch.empty_like(x)

        def separate(w):
            normed, _ = fused_add_rms_norm(x, residual, norm_weight, EPS)
            return gemv(normed, w, None)

        def fused(w):
            return fused_add_rms_norm_gemv(x, residual, norm_weight, EPS, 0.0, False, w, None, summed)

        other_warps = norm_prologue_at(GEMV_WARPS)
        for label, product in (
            ("fused_add_rms_norm + zoo::gemv", separate),
            ("zoo::fused_add_rms_norm_gemv (the RMSNorm kernel's warps)", fused),
            (f"zoo::fused_add_rms_norm_gemv's kernel at {GEMV_WARPS} warps",
             lambda w: other_warps(x, residual, norm_weight, w, summed)),
        ):
            equal = "yes" if torch.equal(separate(weights[0]), product(weights[0])) else "NO"
            print_row(name, n, k, label, graph_us(lambda: [product(w) for w in weights]) / LAYERS, equal)
        del weights


def main():
    bandwidth = hbm_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + write)")
    products()
    fused_prologues()


if __name__ == "__main__":
    main()
