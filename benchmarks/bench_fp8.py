"""FP8 block-scaled GEMMs on DeepSeek-V3's shapes, one GPU: zoo's two block-FP8 GEMMs against each other
and against the bf16 GEMM, and the FP8 fused-MoE kernel against the bf16 one. Random weights.

    python3 benchmarks/bench_fp8.py                    # linear + moe, Markdown tables (~3 minutes on an H200)
    python3 benchmarks/bench_fp8.py --task linear      # the linear layers alone
    python3 benchmarks/bench_fp8.py --task linear --rows 1   # their batch-1 decode products alone
    python3 benchmarks/bench_fp8.py --task moe         # the routed experts alone
    python3 benchmarks/bench_fp8.py --json fp8.json    # also write the figures

linear  zoo::fp8_block_linear's kernels on DeepSeek-V3's linear shapes (hidden 7168, q_lora 1536,
        kv_lora 512 + rope 64, 128 heads of 192 / 128, dense MLP 18432, experts and shared expert 2048,
        vocab 129280), weights in 128 x 128 blocks, at M = 1, 64, 256 and 4096 tokens: the Triton
        block-FP8 GEMM (ops_cuda/fp8_triton.py) and torch._scaled_mm with 1x128 / 128x128 block scales
        (where this torch and GPU have it), each timed with its activation quantisation, against the
        bf16 GEMM (F.linear, cuBLAS) on the same shapes; at M = 1 also the single-row FP8 kernel
        ("gemv", what the op runs there) and zoo::gemv on the bf16 weight ("bf16 gemv", what a bf16
        model runs there); TFLOP/s (2 M N K over the time), and for M <= 64 GB/s (weight, activation
        and output bytes over the time: small M is a stream of the weight).
        The bf16 weight is the FP8 one dequantised, so the bf16 GEMM is also the op's reference
        (dequantise, then matmul): max rel diff, relative to its largest magnitude, is the activations'
        quantisation (the gemv's: the reference's rounding of each dequantised entry). The dispatch's
        column says which kernel zoo::fp8_block_linear runs; SCALED_MM_MIN_ROWS in ops_cuda/fp8_triton.py
        is set from this table.
moe     The routed experts of one DeepSeek-V3 MoE layer (256 experts, top-8, 7168 -> 2048 -> 7168) at
        decode batch sizes 1 to 256 and prefill-sized 1024 and 4096 tokens: the Triton fused-MoE kernel
        (ops_cuda/moe_triton.py) on FP8 experts (zoo::fp8_moe_experts) against the same kernel on bf16
        experts (the FP8 ones dequantised: the op's reference), and against what zoo::moe_experts's
        dispatch picks for bf16; µs, GB/s of the distinct experts the routing touches, max rel diff.
        Then the FP8 experts with DeepSeek-V3's shared expert: as one more pair per token in the fused-MoE
        launch, against its own launches after it (single-row kernel or block-FP8 GEMMs, act_and_mul,
        the add); zoo::fp8_moe_experts runs it in the launch up to SHARED_IN_LAUNCH_MAX_TOKENS tokens.

Times: the median of CUDA-graph replays (CUDA events), the L2 cache flushed before each replay so that
weights come from HBM.
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import graph_us, hbm_bandwidth  # noqa: E402
from ops_cuda.activation import act_and_mul  # noqa: E402
from ops_cuda.fp8 import FP8_DTYPE, FP8_MAX  # noqa: E402
from ops_cuda.fp8_linear import fp8_block_linear  # noqa: E402
from ops_cuda.fp8_triton import (  # noqa: E402
    cuda_kernel,
    fp8_block_gemm_scaled_mm,
    fp8_block_gemm_triton,
    fp8_block_gemv_triton,
    scaled_mm_supported,
)
from ops_cuda.gemv import gemv  # noqa: E402
from ops_cuda.moe import cuda_kernel as moe_cuda_kernel  # noqa: E402
from ops_cuda.moe import SHARED_IN_LAUNCH_MAX_TOKENS, moe_experts_op  # noqa: E402

BLOCK = (128, 128)
# (name, N, K) of DeepSeek-V3's linear layers. kv_b_proj and lm_head stay bf16 in zoo (MLA reads
# kv_b_proj's weight itself; the checkpoint does not quantise lm_head): listed for the GEMM alone.
LINEARS = [
    ("q_a_proj", 1536, 7168),
    ("kv_a_proj_with_mqa", 576, 7168),
    ("q_b_proj", 128 * 192, 1536),
    ("kv_b_proj", 128 * (128 + 128), 512),
    ("o_proj", 7168, 128 * 128),
    ("dense gate_up_proj", 2 * 18432, 7168),
    ("dense down_proj", 7168, 18432),
    ("expert gate_up_proj", 2 * 2048, 7168),
    ("expert down_proj", 7168, 2048),
    ("lm_head", 129280, 7168),
]
# Timed for comparison, but never FP8 in zoo: DeepSeek-V3's checkpoints keep lm_head in bf16, and zoo
# dequantises kv_b_proj on load (the absorbed form reads its weight), so the crossover leaves them out.
NEVER_FP8 = {"kv_b_proj", "lm_head"}
ROWS = (1, 64, 256, 4096)
L2_FLUSH_BYTES = 256 << 20
EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 256, 8, 7168, 2048
MOE_TOKENS = (1, 8, 32, 64, 128, 256, 1024, 4096)


def quantise_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scales, the FP8 weight dequantised to bf16) of a [..., N, K] weight
    whose N and K are whole blocks."""
    *leading, n, k = weight.shape
    blocks = weight.float().view(*leading, n // BLOCK[0], BLOCK[0], k // BLOCK[1], BLOCK[1])
    scales = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=1e-12) / FP8_MAX
    fp8 = (blocks / scales).to(FP8_DTYPE)
    dequantised = (fp8.float() * scales).to(torch.bfloat16).view(weight.shape)
    return fp8.view(weight.shape), scales.view(*leading, n // BLOCK[0], k // BLOCK[1]).contiguous(), dequantised


def random_fp8(n: int, k: int, generator, experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bf16 weight, its FP8 blocks, their scales) of a random weight, the bf16 one the FP8 one dequantised:
    the op's reference multiplies by it. N is padded up to whole blocks for the quantisation."""
    if experts is None:
        weight = torch.randn(n + -n % BLOCK[0], k, device="cuda", generator=generator, dtype=torch.bfloat16) / k**0.5
        fp8, scales, dequantised = quantise_blocks(weight)
        return dequantised[:n].contiguous(), fp8[:n].contiguous(), scales
    weight = torch.empty(experts, n, k, device="cuda", dtype=torch.bfloat16)
    fp8 = torch.empty(weight.shape, dtype=FP8_DTYPE, device="cuda")
    scales = torch.empty(experts, n // BLOCK[0], k // BLOCK[1], device="cuda")
    for e in range(experts):  # one expert at a time: float32 copies of all of them would not fit
        random = torch.randn(n, k, device="cuda", generator=generator, dtype=torch.bfloat16) / k**0.5
        fp8[e], scales[e], weight[e] = quantise_blocks(random)
    return weight, fp8, scales


def linear_shape(name: str, n: int, k: int, row_counts, generator) -> list[dict]:
    """The rows of the linear table for one layer's shape, at each of ``row_counts`` rows."""
    weight, fp8, scales = random_fp8(n, k, generator)
    rows_out = []
    for m in row_counts:
        x = torch.randn(m, k, device="cuda", generator=generator, dtype=torch.bfloat16)
        reference = F.linear(x, weight).float()  # the op's reference: the dequantised weight
        row = dict(layer=name, n=n, k=k, m=m, dispatch=cuda_kernel(x, fp8, BLOCK))
        paths = {"bf16": lambda: F.linear(x, weight),
                 "triton": lambda: fp8_block_gemm_triton(x, fp8, scales, BLOCK, None)}
        if scaled_mm_supported(x, fp8, BLOCK):
            paths["scaled_mm"] = lambda: fp8_block_gemm_scaled_mm(x, fp8, scales, None)
        if m == 1:
            paths["gemv"] = lambda: fp8_block_gemv_triton(x, fp8, scales, BLOCK, None)
            paths["bf16 gemv"] = lambda: gemv(x, weight, None)
        for path, fn in paths.items():
            us = graph_us(fn, flush_l2_bytes=L2_FLUSH_BYTES)
            bf16 = path.startswith("bf16")
            weight_bytes = n * k * (2 if bf16 else 1) + (0 if bf16 else scales.numel() * 4)
            moved = weight_bytes + m * k * 2 + m * n * 2
            row[path] = dict(us=us, tflops=2 * m * n * k / us / 1e6, gb_s=moved / us / 1e3)
            if not bf16:
                row[path]["max_rel_diff"] = ((fn().float() - reference).abs().max() / reference.abs().max()).item()
        rows_out.append(row)
        print(f"{name} M={m}: " + ", ".join(f"{p} {row[p]['us']:.1f} µs" for p in paths), flush=True)
    return rows_out


def linear(results, row_counts=ROWS):
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for name, n, k in LINEARS:
        rows_out += linear_shape(name, n, k, row_counts, generator)
        torch.cuda.empty_cache()  # the shape's weights are gone with linear_shape's frame
    results["linear"] = rows_out


def linear_table(results) -> str:
    paths = ["bf16", "triton", "scaled_mm", "gemv", "bf16 gemv"]
    diff_paths = ("triton", "scaled_mm", "gemv")
    lines = [
        f"DeepSeek-V3 linear shapes, 128 x 128 FP8 blocks, bf16 activations. {results['date']}, {results['device']}, "
        f"torch {results['torch']}, triton {results['triton']}; HBM copy bandwidth {results['hbm_tb_s']:.2f} TB/s.",
        "",
        "| layer | N x K | M | " + " | ".join(f"{p} µs | {p} TFLOP/s | {p} GB/s" for p in paths)
        + " | triton / scaled_mm / gemv max rel diff | dispatch |",
        "|" + "---|" * (3 + 3 * len(paths) + 2),
    ]
    for row in results["linear"]:
        cells = [row["layer"], f"{row['n']} x {row['k']}", str(row["m"])]
        for p in paths:
            if p in row:
                gb_s = f"{row[p]['gb_s']:.0f}" if row["m"] <= 64 else ""
                cells += [f"{row[p]['us']:.1f}", f"{row[p]['tflops']:.1f}", gb_s]
            else:
                cells += ["—", "—", ""]
        diffs = [f"{row[p]['max_rel_diff']:.3f}" if p in row else "—" for p in diff_paths]
        lines.append("| " + " | ".join(cells) + f" | {' / '.join(diffs)} | {row['dispatch']} |")
    return "\n".join(lines)


def crossover(results) -> str:
    """From which M on torch._scaled_mm beats the Triton GEMM on every FP8 layer's shape it takes
    (SCALED_MM_MIN_ROWS)."""
    by_m = {}
    for row in results["linear"]:
        if "scaled_mm" in row and row["layer"] not in NEVER_FP8:
            by_m.setdefault(row["m"], []).append(row["scaled_mm"]["us"] < row["triton"]["us"])
    if not by_m:
        return "torch._scaled_mm's block-scaled GEMM did not run here: the Triton GEMM serves every M."
    wins = [m for m in sorted(by_m) if all(all(by_m[n]) for n in by_m if n >= m)]
    return (f"torch._scaled_mm is faster on every FP8 layer's shape from M = {wins[0]} on (SCALED_MM_MIN_ROWS)" if wins
            else "torch._scaled_mm is never faster on every shape: the Triton GEMM serves every M")


def routing(tokens: int, generator):
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=generator)
    logits += 2.0 * torch.randn(EXPERTS, device="cuda", generator=generator)  # some experts favoured
    weights, ids = logits.sigmoid().topk(TOP_K, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def moe(results):
    from ops_cuda.moe_triton import Fp8Scales, SharedExpert, moe_experts_triton

    generator = torch.Generator(device="cuda").manual_seed(0)
    gate_up, gate_up_fp8, gate_up_scales = random_fp8(2 * INTERMEDIATE, HIDDEN, generator, EXPERTS)
    down, down_fp8, down_scales = random_fp8(HIDDEN, INTERMEDIATE, generator, EXPERTS)
    scales = Fp8Scales(gate_up_scales, down_scales, BLOCK)
    _, shared_gate_up, shared_gate_up_scales = random_fp8(2 * INTERMEDIATE, HIDDEN, generator)
    _, shared_down, shared_down_scales = random_fp8(HIDDEN, INTERMEDIATE, generator)
    shared = SharedExpert(shared_gate_up, shared_down, shared_gate_up_scales, shared_down_scales)
    expert_elements = 3 * INTERMEDIATE * HIDDEN
    rows = []
    for tokens in MOE_TOKENS:
        hidden = torch.randn(tokens, HIDDEN, device="cuda", generator=generator, dtype=torch.bfloat16)
        weights, ids = routing(tokens, generator)
        touched = ids.unique().numel()
        row = dict(tokens=tokens, experts=touched, bf16_dispatch=moe_cuda_kernel(hidden, ids, gate_up, down, "silu"))
        paths = {
            "fp8 triton": (lambda: moe_experts_triton(hidden, weights, ids, gate_up_fp8, down_fp8, "silu", fp8=scales),
                           1),
            "bf16 triton": (lambda: moe_experts_triton(hidden, weights, ids, gate_up, down, "silu"), 2),
            "bf16 dispatch": (lambda: moe_experts_op(hidden, weights, ids, gate_up, down, "silu"), 2),
        }
        for path, (fn, element_bytes) in paths.items():
            us = graph_us(fn, flush_l2_bytes=L2_FLUSH_BYTES)
            row[path] = dict(us=us, gb_s=touched * expert_elements * element_bytes / us / 1e3)
        # The op's reference: the experts dequantised to bf16, which the bf16 runs multiply by.
        reference, ours = paths["bf16 triton"][0]().float(), paths["fp8 triton"][0]().float()
        row["max_rel_diff"] = ((ours - reference).abs().max() / reference.abs().max()).item()

        def shared_apart(hidden=hidden, weights=weights, ids=ids):
            h = act_and_mul(fp8_block_linear(hidden, shared.gate_up, shared.gate_up_scale, BLOCK, None), "silu")
            return (moe_experts_triton(hidden, weights, ids, gate_up_fp8, down_fp8, "silu", fp8=scales)
                    + fp8_block_linear(h, shared.down, shared.down_scale, BLOCK, None))

        row["shared_in_launch_us"] = graph_us(
            lambda: moe_experts_triton(hidden, weights, ids, gate_up_fp8, down_fp8, "silu", fp8=scales, shared=shared),
            flush_l2_bytes=L2_FLUSH_BYTES)
        row["shared_apart_us"] = graph_us(shared_apart, flush_l2_bytes=L2_FLUSH_BYTES)
        rows.append(row)
        print(f"moe {tokens} tokens: " + ", ".join(f"{p} {row[p]['us']:.1f} µs" for p in paths)
              + f"; with the shared expert in the launch {row['shared_in_launch_us']:.1f} µs, "
              f"apart {row['shared_apart_us']:.1f} µs", flush=True)
    results["moe"] = rows


def moe_table(results) -> str:
    paths = ["fp8 triton", "bf16 triton", "bf16 dispatch"]
    lines = [
        f"DeepSeek-V3 routed experts (256 experts, top-8, 7168 -> 2048 -> 7168), FP8 in 128 x 128 blocks vs bf16. "
        f"{results['date']}, {results['device']}.",
        "",
        "| tokens | experts touched | " + " | ".join(f"{p} µs | {p} GB/s" for p in paths)
        + " | fp8 / bf16 triton | bf16 dispatch picks | fp8 max rel diff |",
        "|" + "---|" * (2 + 2 * len(paths) + 3),
    ]
    for row in results["moe"]:
        cells = [str(row["tokens"]), str(row["experts"])]
        for p in paths:
            cells += [f"{row[p]['us']:.1f}", f"{row[p]['gb_s']:.0f}"]
        speed = row["bf16 triton"]["us"] / row["fp8 triton"]["us"]
        diff = f"{row['max_rel_diff']:.3f}" if "max_rel_diff" in row else ""
        lines.append("| " + " | ".join(cells) + f" | {speed:.2f}x | {row['bf16_dispatch']} | {diff} |")
    lines += ["", "FP8 experts with the shared expert (7168 -> 2048 -> 7168, every token's):", "",
              "| tokens | in the fused-MoE launch µs | its own launches after it µs | zoo::fp8_moe_experts takes |",
              "|---|---|---|---|"]
    for row in results["moe"]:
        takes = "in the launch" if row["tokens"] <= SHARED_IN_LAUNCH_MAX_TOKENS else "its own launches"
        lines.append(f"| {row['tokens']} | {row['shared_in_launch_us']:.1f} | {row['shared_apart_us']:.1f} | {takes} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="all", choices=["all", "linear", "moe"])
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS, help=f"linear: the values of M (default {ROWS})")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    results = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "triton": triton.__version__, "hbm_tb_s": hbm_bandwidth() / 1e12}
    print(results, flush=True)
    torch.cuda.empty_cache()
    if args.task in ("all", "linear"):
        linear(results, args.rows)
        crossover_text = crossover(results) if len(args.rows) > 1 else ""  # a crossover needs several M
        print("\n" + linear_table(results) + "\n\n" + crossover_text + "\n", flush=True)
    if args.task in ("all", "moe"):
        moe(results)
        print("\n" + moe_table(results) + "\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
