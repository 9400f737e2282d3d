"""Decode attention's split count on this GPU: every split count against ``decode_num_splits``' pick.

The paged GQA kernel at Llama-3.1-8B's heads (32 query, 8 KV, head dim 128) over a bf16 cache and an
FP8 one (``kv_cache_dtype="fp8"``), and the MLA kernel at DeepSeek-V3's (128 heads over a 512 + 64
latent) over a bf16 pool and an e4m3 one; 16-token cache blocks in random order. Cases: batches of
1-128 sequences of 4,096 tokens; for MLA, batch 1 at the block-table widths of bench_deepseek.py's
steps and longer; for GQA, batches of 64-896 sequences of 1,000-2,000 tokens in a 2,048-token table,
as in bench_gpu.py's 8B throughput run. Per case: the kernel's time at the pick and at every other
candidate count (up to one 64-key tile a split), the fastest, and the pick's time over the fastest's.
CUDA graphs, the L2 cache flushed before every replay, the median of --iters replays.

    python3 benchmarks/bench_decode_splits.py [--iters 30] [--json results.json]
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import graph_us  # noqa: E402
from ops_cuda.fp8 import FP8_DTYPE  # noqa: E402
from ops_cuda.kv_layout import new_kv_cache  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
MLA_HEADS, KV_LORA_RANK, ROPE = 128, 512, 64
BLOCK_SIZE, DTYPE = 16, torch.bfloat16
CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
KEY_TILE = 64
L2_FLUSH_BYTES = 256 << 20


def random_tables(batch: int, width: int) -> torch.Tensor:
    return torch.randperm(batch * width, device="cuda").view(batch, width).to(torch.int32)


def gqa_case(lengths: list[int], width: int, cache_dtype: torch.dtype):
    """A run(num_splits) of the paged GQA decode kernel over ``lengths`` in tables ``width`` blocks wide."""
    from ops_cuda.paged_attention_triton import paged_decode_attention_triton

    batch = len(lengths)
    k_cache, v_cache = new_kv_cache(batch * width, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, cache_dtype, "cuda")
    for cache in (k_cache, v_cache):
        cache.copy_(torch.randn(cache.shape, device="cuda").to(cache_dtype))
    tables = random_tables(batch, width)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    return lambda num_splits: paged_decode_attention_triton(q, k_cache, v_cache, tables, seq_lens, HEAD_DIM**-0.5,
                                                            0, out, num_splits=num_splits)


def mla_case(lengths: list[int], width: int, cache_dtype: torch.dtype):
    """A run(num_splits) of the MLA decode kernel over ``lengths`` in tables ``width`` blocks wide."""
    from ops_cuda.mla_attention_triton import mla_decode_attention_triton

    batch = len(lengths)
    cache = torch.randn(batch * width, BLOCK_SIZE, KV_LORA_RANK + ROPE, device="cuda").to(cache_dtype)
    tables = random_tables(batch, width)
    q_latent = torch.randn(batch, MLA_HEADS, KV_LORA_RANK, dtype=DTYPE, device="cuda")
    q_rope = torch.randn(batch, MLA_HEADS, ROPE, dtype=DTYPE, device="cuda")
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q_latent)
    return lambda num_splits: mla_decode_attention_triton(q_latent, q_rope, cache, tables, seq_lens, 0.07, out,
                                                          num_splits=num_splits)


def cases() -> list[tuple[str, str, list[int], int]]:
    """(kernel, cache, sequence lengths, table width in blocks) of every case."""
    ragged = torch.Generator().manual_seed(0)
    out = []
    for kernel, batches in (("gqa", (1, 2, 4, 8, 16, 32, 64, 128)), ("mla", (1, 2, 4, 8, 16, 32, 48, 64, 96, 128))):
        for cache in ("bf16", "e4m3"):
            out += [(kernel, cache, [4096] * batch, 4096 // BLOCK_SIZE) for batch in batches]
    for cache in ("bf16", "e4m3"):
        out += [("mla", cache, [length], -(-length // BLOCK_SIZE)) for length in (1025, 1152, 2049, 8193)]
    for cache, batches in (("bf16", (64, 128, 256, 448)), ("e4m3", (256, 448, 896))):
        for batch in batches:
            lengths = torch.randint(1000, 2001, (batch,), generator=ragged).tolist()
            out.append(("gqa", cache, lengths, 2048 // BLOCK_SIZE))
    return out


def measure(kernel: str, cache: str, lengths: list[int], width: int, iters: int) -> dict:
    build = gqa_case if kernel == "gqa" else mla_case
    run = build(lengths, width, DTYPE if cache == "bf16" else FP8_DTYPE)
    pick = run(None)
    counts = sorted({*(s for s in CANDIDATES if s <= -(-width * BLOCK_SIZE // KEY_TILE)), pick})
    us = {s: graph_us(lambda: run(s), iters, flush_l2_bytes=L2_FLUSH_BYTES) for s in counts}
    fastest = min(us, key=us.get)
    return {"kernel": kernel, "cache": cache, "batch": len(lengths), "lengths": f"{min(lengths)}-{max(lengths)}"
            if min(lengths) != max(lengths) else str(lengths[0]), "table": width * BLOCK_SIZE, "pick": pick,
            "fastest": fastest, "us": us}


TABLE_HEADER = ("| kernel | cache | batch | tokens | table | pick | µs | fastest | µs | pick / fastest "
                "| every count (µs) |\n|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|")


def table_row(r: dict) -> str:
    us = r["us"]
    return (f"| {r['kernel']} | {r['cache']} | {r['batch']} | {r['lengths']} | {r['table']} | {r['pick']} | "
            f"{us[r['pick']]:.1f} | {r['fastest']} | {us[r['fastest']]:.1f} | {us[r['pick']] / us[r['fastest']]:.3f} | "
            + ", ".join(f"{s}: {t:.1f}" for s, t in us.items()) + " |")


def summary(rows: list[dict]) -> str:
    ratios = sorted(r["us"][r["pick"]] / r["us"][r["fastest"]] for r in rows)
    return f"pick / fastest over {len(rows)} cases: median {ratios[len(ratios) // 2]:.3f}, largest {ratios[-1]:.3f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_splits.py needs a CUDA device")
    import triton

    torch.manual_seed(0)
    print(f"Decode attention's split count — {datetime.date.today()}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, triton {triton.__version__}\n\n{TABLE_HEADER}", flush=True)
    rows = []
    for case in cases():  # a row as each case is measured, so that a run cut short keeps its rows
        rows.append(measure(*case, args.iters))
        print(table_row(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    print(f"\n{summary(rows)}")
    if args.json:
        record = {"device": torch.cuda.get_device_name(), "date": str(datetime.date.today()), "cases": rows}
        Path(args.json).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
