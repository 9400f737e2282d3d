"""Attention kernel speed on this GPU: zoo's Triton paged attention ops against the torch backend
(their PyTorch references) and PyTorch's SDPA on contiguous K/V.

Llama-3.1-8B attention: 32 query heads, 8 KV heads, head dim 128, bfloat16, cache blocks of 16
tokens placed in random order. Decode: batch 1/16/64 x 1k/4k-token sequences, latency and
achieved K/V read bandwidth (bytes of K and V read / time). Prefill: 1 and 4 x 4096-token and
8 x 1024-token prompts, TFLOP/s of causal attention (2 * T^2 * H * D multiply-adds per sequence:
half of full attention), for the paged kernel (which reads every key from the cache, as a prompt
after cached context does) and for ``prompt_attention`` (which a prompt with nothing cached runs on
its own k/v: flash attention).

With ``--kv-cache-dtype fp8`` it times decode over an e4m3 cache (the same bf16 randn entries cast,
scale 1.0, V key-minor as the runtime stores it) beside the bf16 cache instead, at 1 x 4096,
64 x 4096, 450 x 1536 and 900 x 1536 tokens, in µs and TB/s of cache bytes read, and the paged
prefill kernel over both (prompts over an FP8 cache read their keys back from it) on 4 x 4096 and
8 x 1024-token prompts.

Each case is captured in a CUDA graph and replayed (no launch overhead), with the L2 cache
flushed before every replay; the median of --iters replays is reported.

    .venv/bin/python benchmarks/bench_attention.py [--kv-cache-dtype fp8] [--json results.json]
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import graph_us  # noqa: E402
from ops_cuda.fp8 import FP8_DTYPE  # noqa: E402
from ops_cuda.kv_cache import quantize  # noqa: E402
from ops_cuda.kv_layout import new_kv_cache  # noqa: E402
from ops_cuda.paged_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention,
)
from ops_cuda.prompt_attention import prompt_attention  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
L2_FLUSH_BYTES = 256 << 20


def device_ms(fn, iters: int) -> float:
    return graph_us(fn, iters, flush_l2_bytes=L2_FLUSH_BYTES) / 1e3


def paged_cache(batch: int, seq_len: int):
    """K/V of `batch` sequences of `seq_len` tokens in randomly placed cache blocks, and the
    same keys/values contiguous [B, Hkv, T, D] for SDPA."""
    width = -(-seq_len // BLOCK_SIZE)
    block_tables = torch.randperm(batch * width, device="cuda").view(batch, width).to(torch.int32)
    keys = torch.randn(batch, seq_len, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    values = torch.randn_like(keys)
    shape = (batch * width, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape, dtype=DTYPE, device="cuda"), torch.zeros(shape, dtype=DTYPE, device="cuda")
    padded = width * BLOCK_SIZE
    for cache, source in ((k_cache, keys), (v_cache, values)):
        full = F.pad(source, (0, 0, 0, 0, 0, padded - seq_len)).view(batch, width, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        cache[block_tables.long()] = full
    return k_cache, v_cache, block_tables, keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()


def bench_decode(batch: int, seq_len: int, iters: int) -> dict:
    k_cache, v_cache, block_tables, keys, values = paged_cache(batch, seq_len)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM**-0.5
    args = (q, k_cache, v_cache, block_tables, seq_lens, scale, 0)
    ms = {
        "triton": device_ms(lambda: paged_decode_attention(*args), iters),
        "torch": device_ms(lambda: paged_decode_attention_reference(*args), iters),
        "sdpa": device_ms(lambda: F.scaled_dot_product_attention(
            q[:, :, None], keys, values, scale=scale, enable_gqa=True), iters),
    }
    kv_bytes = 2 * batch * seq_len * NUM_KV_HEADS * HEAD_DIM * keys.element_size()
    return {"batch": batch, "seq_len": seq_len, "us": {k: v * 1e3 for k, v in ms.items()},
            "gb_s": {k: kv_bytes / (v * 1e-3) / 1e9 for k, v in ms.items()}}


# 900 x 1,500: a length the key tiles do not divide, as in the 8B throughput run, whose sequences end anywhere.
FP8_DECODE_SHAPES = ((1, 4096), (64, 4096), (450, 1536), (900, 1536), (900, 1500))


def bf16_and_fp8_caches(batch: int, seq_len: int) -> tuple[dict, torch.Tensor]:
    """The bf16 caches of `paged_cache` and their entries cast to e4m3 (scale 1.0, laid out as the
    runtime's: V key-minor), by name, and their block tables."""
    k_cache, v_cache, block_tables, _, _ = paged_cache(batch, seq_len)
    fp8_caches = new_kv_cache(*k_cache.shape, FP8_DTYPE, "cuda")
    for fp8_cache, cache in zip(fp8_caches, (k_cache, v_cache)):
        fp8_cache.copy_(quantize(cache, 1.0, FP8_DTYPE))
    return {"bf16": (k_cache, v_cache), "e4m3": fp8_caches}, block_tables


def e4m3_difference(outputs: dict) -> float:
    """The e4m3 cache's output's largest difference from the bf16 cache's, relative to its largest
    magnitude."""
    return ((outputs["e4m3"] - outputs["bf16"]).abs().max() / outputs["bf16"].abs().max()).item()


def bench_fp8_decode(batch: int, seq_len: int, iters: int) -> dict:
    """zoo::paged_decode_attention over the bf16 cache and over its entries cast to e4m3."""
    caches, block_tables = bf16_and_fp8_caches(batch, seq_len)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    entries = 2 * batch * seq_len * NUM_KV_HEADS * HEAD_DIM
    us, tb_s, outputs = {}, {}, {}
    for name, (k, v) in caches.items():
        args = (q, k, v, block_tables, seq_lens, HEAD_DIM**-0.5, 0)
        us[name] = device_ms(lambda args=args: paged_decode_attention(*args), iters) * 1e3
        tb_s[name] = entries * k.element_size() / (us[name] * 1e-6) / 1e12
        outputs[name] = paged_decode_attention(*args).float()
    return {"batch": batch, "seq_len": seq_len, "us": us, "tb_s": tb_s, "e4m3_difference": e4m3_difference(outputs)}


# Prompts over an FP8 cache read their keys back from it through the paged prefill kernel.
FP8_PREFILL_SHAPES = ((4, 4096), (8, 1024))


def bench_fp8_prefill(batch: int, seq_len: int, iters: int) -> dict:
    """zoo::paged_prefill_attention of fresh prompts over the bf16 cache and over its entries cast
    to e4m3."""
    caches, block_tables = bf16_and_fp8_caches(batch, seq_len)
    q = torch.randn(batch * seq_len, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    # The new tokens' k and v, which the kernel reads back from the cache instead.
    k = v = torch.randn(batch * seq_len, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    query_start_loc = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device="cuda")
    flops = 2 * batch * NUM_HEADS * HEAD_DIM * seq_len * seq_len
    ms, tflop_s, outputs = {}, {}, {}
    for name, (k_cache, v_cache) in caches.items():
        args = (q, k, v, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seq_len, HEAD_DIM**-0.5, 0)
        ms[name] = device_ms(lambda args=args: paged_prefill_attention(*args), iters)
        tflop_s[name] = flops / (ms[name] * 1e-3) / 1e12
        outputs[name] = paged_prefill_attention(*args).float()
    return {"batch": batch, "seq_len": seq_len, "ms": ms, "tflop_s": tflop_s,
            "e4m3_difference": e4m3_difference(outputs)}


def fp8_markdown(decode: list[dict], prefill: list[dict], header: str) -> str:
    lines = [header, "", "Decode", "", "| batch | seq len | bf16 cache µs / TB/s | e4m3 cache µs / TB/s | "
             "e4m3 output's difference |", "|---:|---:|---:|---:|---:|"]
    for r in decode:
        cells = [f"{r['us'][k]:.1f} / {r['tb_s'][k]:.2f}" for k in ("bf16", "e4m3")]
        lines.append(f"| {r['batch']} | {r['seq_len']} | " + " | ".join(cells) + f" | {r['e4m3_difference']:.1e} |")
    lines += ["", "Prefill, fresh prompts, paged kernel", "", "| batch | prompt | bf16 cache ms / TFLOP/s | "
              "e4m3 cache ms / TFLOP/s | e4m3 output's difference |", "|---:|---:|---:|---:|---:|"]
    for r in prefill:
        cells = [f"{r['ms'][k]:.3f} / {r['tflop_s'][k]:.0f}" for k in ("bf16", "e4m3")]
        lines.append(f"| {r['batch']} | {r['seq_len']} | " + " | ".join(cells) + f" | {r['e4m3_difference']:.1e} |")
    return "\n".join(lines)


def bench_prefill(batch: int, seq_len: int, iters: int) -> dict:
    k_cache, v_cache, block_tables, keys, values = paged_cache(batch, seq_len)
    q = torch.randn(batch, NUM_HEADS, seq_len, HEAD_DIM, dtype=DTYPE, device="cuda")
    flat_q = q.transpose(1, 2).reshape(batch * seq_len, NUM_HEADS, HEAD_DIM)
    flat_k = keys.transpose(1, 2).reshape(batch * seq_len, NUM_KV_HEADS, HEAD_DIM)
    flat_v = values.transpose(1, 2).reshape(batch * seq_len, NUM_KV_HEADS, HEAD_DIM)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    query_start_loc = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM**-0.5
    args = (flat_q, flat_k, flat_v, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seq_len, scale, 0)
    ms = {
        "triton": device_ms(lambda: paged_prefill_attention(*args), iters),
        "prompt": device_ms(lambda: prompt_attention(flat_q, flat_k, flat_v, query_start_loc, seq_len, scale, 0),
                            iters),
        "sdpa": device_ms(lambda: F.scaled_dot_product_attention(
            q, keys, values, is_causal=True, scale=scale, enable_gqa=True), iters),
    }
    flops = 2 * batch * NUM_HEADS * HEAD_DIM * seq_len * seq_len  # causal half of 4 * T^2 * H * D
    return {"batch": batch, "seq_len": seq_len, "ms": ms,
            "tflop_s": {k: flops / (v * 1e-3) / 1e12 for k, v in ms.items()}}


def markdown(decode: list[dict], prefill: list[dict], header: str) -> str:
    lines = [header, "", "Decode (latency µs / K+V read GB/s)", "",
             "| batch | seq len | zoo triton | torch backend | SDPA contiguous |", "|---:|---:|---:|---:|---:|"]
    for r in decode:
        cells = [f"{r['us'][k]:.1f} / {r['gb_s'][k]:.0f}" for k in ("triton", "torch", "sdpa")]
        lines.append(f"| {r['batch']} | {r['seq_len']} | " + " | ".join(cells) + " |")
    lines += ["", "Prefill, fresh prompts (ms / TFLOP/s)", "",
              "| batch | prompt | zoo triton, paged | zoo prompt_attention | SDPA contiguous |",
              "|---:|---:|---:|---:|---:|"]
    for r in prefill:
        cells = [f"{r['ms'][k]:.3f} / {r['tflop_s'][k]:.0f}" for k in ("triton", "prompt", "sdpa")]
        lines.append(f"| {r['batch']} | {r['seq_len']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="fp8: decode and the paged prefill over an e4m3 cache beside the bf16 cache")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA device")
    import triton

    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    if args.kv_cache_dtype == "fp8":
        decode, prefill = [], []
        for batch, seq_len in FP8_DECODE_SHAPES:
            decode.append(bench_fp8_decode(batch, seq_len, args.iters))
            torch.cuda.empty_cache()
        for batch, seq_len in FP8_PREFILL_SHAPES:
            prefill.append(bench_fp8_prefill(batch, seq_len, args.iters))
            torch.cuda.empty_cache()
        header = (f"FP8 KV cache attention, Llama-3.1-8B shape (Hq {NUM_HEADS}, Hkv {NUM_KV_HEADS}, D {HEAD_DIM}, "
                  f"bf16 queries, block {BLOCK_SIZE}) — {datetime.date.today()}, {device}, "
                  f"torch {torch.__version__}, triton {triton.__version__}")
        print(fp8_markdown(decode, prefill, header))
        if args.json:
            Path(args.json).write_text(json.dumps({"device": device, "date": str(datetime.date.today()),
                                                   "fp8_decode": decode, "fp8_prefill": prefill}, indent=2))
        return
    decode = [bench_decode(b, n, args.iters) for b in (1, 16, 64) for n in (1024, 4096)]
    prefill = [bench_prefill(b, n, args.iters) for b, n in ((1, 4096), (4, 4096), (8, 1024))]
    header = (f"Attention kernels, Llama-3.1-8B shape (Hq {NUM_HEADS}, Hkv {NUM_KV_HEADS}, D {HEAD_DIM}, bf16, "
              f"block {BLOCK_SIZE}) — {datetime.date.today()}, {device}, "
              f"torch {torch.__version__}, triton {triton.__version__}")
    print(markdown(decode, prefill, header))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "date": str(datetime.date.today()),
                                               "decode": decode, "prefill": prefill}, indent=2))


if __name__ == "__main__":
    main()
