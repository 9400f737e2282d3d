"""GPU micro-benchmark: zoo's Triton kernels against the ops' PyTorch references (eager).

Each row runs the registered op on CUDA tensors (its Triton kernel) and the op's ``*_reference``
function, checks they agree, and reports:

* µs: median of ``triton.testing.do_bench`` (L2 flushed before every call; launch overhead
  included, which dominates the one-row cases);
* GB/s: bytes the op must move (every input read once, every output written once) / that time;
* µs in graph: median of ``triton.testing.do_bench_cudagraph``, the op replayed from a CUDA graph
  as the runtime's decode steps are (no launch overhead). The reference KV write cannot be
  captured: it selects the valid slots with a boolean mask, a host sync.

A second table times each fused op against the separate zoo ops it replaces (the same kernels
the layers call without the fusion), at one token (batch-1 decode), 256 and 8,192, over a cache of
the model's dtype and over an e4m3 one; and latent attention's norm, rotary and pool write
(DeepSeek-V3's shape) against its four launches.

    .venv/bin/python benchmarks/bench_ops.py [--dtype bfloat16] [--json results.json]
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from ops_cuda import (  # noqa: E402
    act_and_mul, apply_rotary, fused_add_rms_norm, rms_norm, rotary_write_kv, write_kv_cache,
)
from ops_cuda.activation import act_and_mul_reference  # noqa: E402
from ops_cuda.fp8 import FP8_DTYPE  # noqa: E402
from ops_cuda.kv_cache import write_kv_cache_reference  # noqa: E402
from ops_cuda.kv_layout import new_kv_cache  # noqa: E402
from ops_cuda.norm import fused_add_rms_norm_reference, rms_norm_reference  # noqa: E402
from ops_cuda.rotary import apply_rotary_reference  # noqa: E402

EPS = 1e-6


def rope_table(n: int, rotary_dim: int):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cuda") / rotary_dim))
    emb = torch.cat([torch.arange(n, device="cuda")[:, None].float() * inv_freq] * 2, dim=-1)
    return emb.cos(), emb.sin()


def cases(dtype):
    """(name, shape label, zoo op, reference, args, bytes moved), built lazily one at a time."""
    size = torch.tensor([], dtype=dtype).element_size()

    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, device="cuda")

    for n in (4096, 1):
        x, residual, weight = randn(n, 4096), randn(n, 4096), randn(4096)
        yield "rms_norm", f"[{n}, 4096]", rms_norm, rms_norm_reference, (x, weight, EPS), (2 * n + 1) * 4096 * size
        yield ("fused_add_rms_norm", f"[{n}, 4096]", fused_add_rms_norm, fused_add_rms_norm_reference,
               (x, residual, weight, EPS), (4 * n + 1) * 4096 * size)

    # q-norm over head_dim on the q view of a fused qkv (Qwen3 shapes: 32 q heads, 8 kv heads).
    qkv = randn(8192, (32 + 2 * 8) * 128)
    q, k, _ = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
    q, k = q.view(8192, 32, 128), k.view(8192, 8, 128)
    yield ("rms_norm (q-norm)", "[8192, 32, 128] strided", rms_norm, rms_norm_reference,
           (q, randn(128), EPS), 2 * q.numel() * size)

    cos, sin = rope_table(8192, 128)
    for interleaved in (False, True):
        name = "apply_rotary" + (" (interleaved)" if interleaved else "")
        table_bytes = (1 if interleaved else 2) * cos.numel() * 4  # interleaved reads half of cos and sin
        yield (name, "q [8192, 32, 128], k [8192, 8, 128]", apply_rotary, apply_rotary_reference,
               (q, k, cos, sin, interleaved), 2 * (q.numel() + k.numel()) * size + table_bytes)
    del qkv, q, k

    for n in (4096, 1):
        x = randn(n, 2 * 14336)
        yield ("act_and_mul (silu)", f"[{n}, 2 x 14336]", act_and_mul, act_and_mul_reference,
               (x, "silu"), 3 * n * 14336 * size)

    n, heads, head_dim, block_size = 8192, 8, 128, 16
    k, v = randn(n, heads, head_dim), randn(n, heads, head_dim)
    k_cache, v_cache = torch.zeros(2, n // block_size + 1, block_size, heads, head_dim, dtype=dtype, device="cuda")
    slots = torch.randperm(k_cache.shape[0] * block_size, device="cuda")[:n]
    yield ("write_kv_cache", f"{n} tokens x {heads} x {head_dim}", write_kv_cache, write_kv_cache_reference,
           (k, v, k_cache, v_cache, slots), 4 * k.numel() * size + slots.numel() * 8)


def fusion_cases(dtype):
    """(name, shape label, fused call, separate calls): each returns its outputs, the caches last.
    Llama-3.1-8B's attention shape (32 q heads, 8 KV heads of 128), and Qwen3-8B's (the same, with
    per-head q/k-norm), at one token (batch-1 decode), 256 (a decode step) and 8,192 (a throughput
    run's prompt step); and over an e4m3 cache (V key-minor, as the runtime lays it out) at one token
    and 8,192."""
    q_heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    for n, cache_dtype in ((1, dtype), (256, dtype), (8192, dtype), (1, FP8_DTYPE), (8192, FP8_DTYPE)):
        qkv = torch.randn(n, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device="cuda")
        q, k, v = (t.view(n, -1, head_dim) for t in qkv.split([q_heads * head_dim] + [kv_heads * head_dim] * 2, -1))
        cos, sin = rope_table(n, head_dim)
        k_cache, v_cache = new_kv_cache(4 * n // block_size + 1, block_size, kv_heads, head_dim, cache_dtype, "cuda")
        k_cache.zero_()
        v_cache.zero_()
        if n > 256:  # a prompt step: each cache block filled in order, the blocks anywhere
            blocks = torch.randperm(k_cache.shape[0], device="cuda")[: -(-n // block_size)]
            slots = (blocks[:, None] * block_size + torch.arange(block_size, device="cuda")).flatten()[:n]
        else:  # decode steps: a token of each sequence, anywhere
            slots = torch.randperm(k_cache.shape[0] * block_size, device="cuda")[:n]
        q_weight, k_weight = torch.randn(2, head_dim, dtype=dtype, device="cuda")
        cache = "" if cache_dtype == dtype else ", e4m3 cache"
        shape = f"{n} tokens, q {q_heads} x {head_dim}, kv {kv_heads} x {head_dim}{cache}"

        def fused(norm):
            weights = (q_weight, k_weight, EPS) if norm else ()
            return (*rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots, 1.0, 1.0, False, *weights),
                    k_cache, v_cache)

        def separate(norm):
            q_in, k_in = (rms_norm(q, q_weight, EPS), rms_norm(k, k_weight, EPS)) if norm else (q, k)
            q_out, k_out = apply_rotary(q_in, k_in, cos, sin)
            write_kv_cache(k_out, v, k_cache, v_cache, slots)
            return q_out, k_out, k_cache, v_cache

        yield "rotary + KV write", shape, lambda: fused(False), lambda: separate(False)
        if not cache:
            yield "q/k-norm + rotary + KV write", shape, lambda: fused(True), lambda: separate(True)
    yield from latent_fusion_cases(dtype)


def latent_fusion_cases(dtype):
    """DeepSeek-V3's latent attention (128 heads, rope 64, latent 512): the latent's norm, the rotary
    of the queries' rope part and the rope key, and the write of both into the pool's columns, as
    ``layers.mla.MLAttention`` runs them in one op, against the copies, norm, rotary and write it
    replaces; at one token and 256, and one token over an e4m3 pool."""
    heads, rank, rope, nope, block_size = 128, 512, 64, 128, 16
    for n, cache_dtype in ((1, dtype), (256, dtype), (1, FP8_DTYPE)):
        q_rope = torch.randn(n, heads, nope + rope, dtype=dtype, device="cuda")[..., nope:]
        latent_and_rope = torch.randn(n, rank + rope, dtype=dtype, device="cuda")
        latent, k_rope = latent_and_rope.split([rank, rope], -1)
        cos, sin = rope_table(n, rope)
        pool = torch.zeros(4 * n // block_size + 1, block_size, rank + rope, dtype=cache_dtype, device="cuda")
        rope_cache, latent_cache = pool[:, :, None, rank:], pool[:, :, None, :rank]
        slots = torch.randperm(pool.shape[0] * block_size, device="cuda")[:n]
        weight = torch.randn(rank, dtype=dtype, device="cuda")
        cache = "" if cache_dtype == dtype else ", e4m3 pool"

        def fused():
            q_out, k_out = rotary_write_kv(q_rope, k_rope[:, None], latent[:, None], cos, sin, rope_cache,
                                           latent_cache, slots, 1.0, 1.0, True, norm_eps=1e-6, v_norm_weight=weight)
            return q_out, k_out, pool

        def separate():
            normed = rms_norm(latent.contiguous(), weight, 1e-6)
            q_out, k_out = apply_rotary(q_rope.contiguous(), k_rope.reshape(n, 1, -1), cos, sin, True)
            write_kv_cache(normed[:, None], k_out, latent_cache, rope_cache, slots)
            return q_out, k_out, pool

        yield ("latent norm + rotary + pool write", f"{n} tokens, q rope {heads} x {rope}, latent {rank}{cache}",
               fused, separate)


def max_difference(op, reference, args) -> float:
    if op is write_kv_cache:
        k, v, k_cache, v_cache, slots = args
        expected = k_cache.clone(), v_cache.clone()
        reference(k, v, *expected, slots)
        op(*args)
        return max((a.float() - b.float()).abs().max().item() for a, b in zip((k_cache, v_cache), expected))
    ours, theirs = op(*args), reference(*args)
    ours, theirs = (ours, theirs) if isinstance(ours, tuple) else ((ours,), (theirs,))
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(ours, theirs))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)

    rows = []
    for name, shape, op, reference, op_args, nbytes in cases(dtype):
        row = {"op": name, "shape": shape, "max_abs_diff": max_difference(op, reference, op_args)}
        for side, fn in (("zoo", op), ("torch", reference)):
            ms = do_bench(lambda: fn(*op_args), return_mode="median")
            capturable = fn is not write_kv_cache_reference  # its boolean-mask indexing syncs with the host
            graph_ms = do_bench_cudagraph(lambda: fn(*op_args), return_mode="median") if capturable else None
            row[f"{side}_us"], row[f"{side}_gbps"] = ms * 1e3, nbytes / (ms * 1e-3) / 1e9
            row[f"{side}_graph_us"] = None if graph_ms is None else graph_ms * 1e3
        rows.append(row)

    def us(value):
        return "n/a" if value is None else f"{value:.1f}"

    print(f"zoo ops vs PyTorch reference, {args.dtype}, {datetime.date.today().isoformat()}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}\n")
    print("| op | shape | zoo µs | zoo GB/s | torch µs | torch GB/s | speedup "
          "| zoo µs in graph | torch µs in graph | max abs diff |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['op']} | {r['shape']} | {r['zoo_us']:.1f} | {r['zoo_gbps']:.0f} | {r['torch_us']:.1f} | "
              f"{r['torch_gbps']:.0f} | {r['torch_us'] / r['zoo_us']:.2f}x | {us(r['zoo_graph_us'])} | "
              f"{us(r['torch_graph_us'])} | {r['max_abs_diff']:.2g} |")

    fusion_rows = []
    for name, shape, fused, separate in fusion_cases(dtype):
        outputs = separate()
        theirs = [t.clone() for t in outputs]
        for cache in outputs[2:]:  # emptied, so that the fused op's writes are what is compared
            cache.zero_()
        ours = fused()
        row = {"ops": name, "shape": shape,
               "max_abs_diff": max((a.float() - b.float()).abs().max().item() for a, b in zip(ours, theirs))}
        for side, fn in (("fused", fused), ("separate", separate)):
            row[f"{side}_us"] = do_bench(fn, return_mode="median") * 1e3
            row[f"{side}_graph_us"] = do_bench_cudagraph(fn, return_mode="median") * 1e3
        fusion_rows.append(row)
    print("\n| fused ops | shape | fused µs | separate µs | fused µs in graph | separate µs in graph | max abs diff |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in fusion_rows:
        print(f"| {r['ops']} | {r['shape']} | {r['fused_us']:.1f} | {r['separate_us']:.1f} | "
              f"{r['fused_graph_us']:.1f} | {r['separate_graph_us']:.1f} | {r['max_abs_diff']:.2g} |")
    if args.json:
        meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "dtype": args.dtype,
                "torch": torch.__version__, "triton": triton.__version__}
        Path(args.json).write_text(json.dumps({**meta, "rows": rows, "fusion_rows": fusion_rows}, indent=2))


if __name__ == "__main__":
    main()
