"""Probe, seventh session: SmolLM2's Q4_1 weights kept in 4 bits, multiplied by torch's CPU int4 op.

The GGUF's layer weights are Q4_1: blocks of 32 with a scale d and a minimum m, w = d q + m for
q in 0..15. ``torch.ops.aten._weight_int4pack_mm_for_cpu`` computes with (q - 8) s + z per group
of 32, so s = d and z = m + 8 d give the same weights in an eighth of float32's bytes. This checks
that mapping on random blocks, then times the 120 products of SmolLM2's 30 layers (random
weights) at 1 and 16 rows: the int4 op (bfloat16 activations; float32 ones are tens of times
slower) against float32 weights packed for MKL, as zoo multiplies them.

    .venv/bin/python benchmarks/results/cpu-2026-11-29-s7/int4_products.py
"""

import time

import torch

GROUP = 32
SHAPES = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)]  # qkv, o, gate_up, down


def q4_1_layer(out_features, in_features):
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32)
    d = torch.rand(out_features, in_features // GROUP) * 0.01
    m = -torch.rand(out_features, in_features // GROUP) * 0.05
    weight = (q.view(out_features, -1, GROUP) * d[..., None] + m[..., None]).view(out_features, in_features)
    scales_and_zeros = torch.stack([d, m + 8 * d], -1).transpose(0, 1).contiguous()  # [groups, out, 2]
    return q, weight, scales_and_zeros


def best_of(runs, products):
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        products()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main():
    torch.manual_seed(0)
    q, weight, scales_and_zeros = q4_1_layer(*SHAPES[2])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    x = torch.randn(16, SHAPES[2][1])
    error = (torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_and_zeros) - x @ weight.T).abs().max()
    print(f"Q4_1 as int4 groups, float32 activations: largest difference from x @ W^T {float(error):.1e}")

    layers = []
    for _ in range(30):
        for shape in SHAPES:
            q, weight, scales_and_zeros = q4_1_layer(*shape)
            weight = weight.t().contiguous().t()  # column-major, as zoo lays out CPU weights
            layers.append((weight, torch.ops.mkl._mkl_reorder_linear_weight(weight, 16),
                           torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_and_zeros.bfloat16()))
    with torch.inference_mode():
        for rows in (1, 16):
            inputs = {k: torch.randn(rows, k) for k in (576, 1536)}
            bf16_inputs = {k: v.bfloat16() for k, v in inputs.items()}

            def float32_mkl():
                for weight, mkl_pack, _, _ in layers:
                    torch.ops.mkl._mkl_linear(inputs[weight.shape[1]], mkl_pack, weight, None, rows)

            def int4():
                for weight, _, int4_pack, scales in layers:
                    torch.ops.aten._weight_int4pack_mm_for_cpu(bf16_inputs[weight.shape[1]], int4_pack, GROUP, scales)

            print(f"{rows:2d} rows, 120 products: float32 packed for MKL {best_of(5, float32_mkl):.1f} ms, "
                  f"int4 (bfloat16 activations) {best_of(5, int4):.1f} ms")


if __name__ == "__main__":
    main()
