"""MLA attention on this GPU. Decode: zoo's Triton kernel over the latent paged cache
(``zoo::mla_decode_attention``) against the latent cache's read roofline, the torch backend's path
(its PyTorch reference) and PyTorch's SDPA on K/V decompressed per head. Prefill: zoo's Triton
kernel over decompressed keys, and ``zoo::mla_prefill_attention`` where it runs flash attention
instead (q/k and v heads of one width), against SDPA on the same q/k/v.

DeepSeek-V3's attention: 128 heads, kv_lora_rank 512, rope 64 (one cache entry of 576 bf16 values
per token, shared by all heads), qk head dim 192 and v head dim 128 once decompressed; cache blocks
of 16 tokens (the runtime's default) placed in random order. Batch 1, 64 and 256 sequences of
4096 tokens; the Triton kernel over a bf16 pool and over an e4m3 one (``kv_cache_dtype="fp8"``).
Per case: µs per call, GB/s of latent cache read (batch x tokens x 576 x 2 bytes / time, 1 byte
over e4m3), that as a share of the HBM bandwidth measured in the same run (a 4 GiB device-to-device
copy, as benchmarks/bench_gpu.py measures it) and of the H200's 4.8 TB/s spec, and the TFLOP/s of
the scores and the attended latent (each token's 576 + 512 multiply-adds per head): with 128
heads a step does ~240 FLOP per byte of cache, near the H200's bf16 ridge, so both ceilings count.
``--sweep`` adds the kernel's time at 16, 32 and 64 heads per program, with 32- and 64-key tiles,
and at 1 to 64 splits of each sequence's keys. Prefill: 4 new prompts of 4096 tokens (nothing
cached), causal; the TFLOP/s of the scores (192 multiply-adds per key and head) and the attended
values (128), over the causal half of each prompt's square; then the same at GLM-4.7-Flash's heads
(20 heads, qk head dim 192 + 64, v head dim 256), whose wider tiles take fewer stages or query rows.

Each case is captured in a CUDA graph and replayed (no launch overhead), for decode with the L2
cache flushed before every replay; the median of --iters replays is reported.

    python3 benchmarks/bench_mla.py [--sweep] [--iters 50] [--json results.json]
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

from bench_gpu import graph_us, hbm_bandwidth  # noqa: E402
from ops_cuda.fp8 import FP8_DTYPE  # noqa: E402
from ops_cuda.mla_attention import (  # noqa: E402
    mla_decode_attention, mla_decode_attention_reference, mla_prefill_attention, prefill_takes_flash, whole_heads,
)
from ops_cuda.mla_attention_triton import mla_prefill_attention_triton  # noqa: E402

NUM_HEADS, KV_LORA_RANK, ROPE, NOPE, V_DIM = 128, 512, 64, 128, 128
BLOCK_SIZE, DTYPE, SEQ_LEN = 16, torch.bfloat16, 4096
PREFILL_PROMPTS = 4
# (name, heads, nope, v head dim) of the prefill cases; the rope part is ROPE in both
PREFILL_SHAPES = [("DeepSeek-V3", NUM_HEADS, NOPE, V_DIM), ("GLM-4.7-Flash", 20, 192, 256)]
SPEC_BANDWIDTH = 4.8e12  # H200 HBM3e, bytes/s
L2_FLUSH_BYTES = 256 << 20
# SDPA's decompressed K/V take (192 + 128) x 2 bytes per token and head: past this it is left out.
SDPA_MAX_BYTES = 40 << 30


def device_us(fn, iters: int) -> float:
    return graph_us(fn, iters, flush_l2_bytes=L2_FLUSH_BYTES)


def latent_cache(batch: int, seq_len: int):
    """The latent entries of ``batch`` sequences of ``seq_len`` tokens in randomly placed blocks."""
    width = -(-seq_len // BLOCK_SIZE)
    block_tables = torch.randperm(batch * width, device="cuda").view(batch, width).to(torch.int32)
    cache = torch.randn(batch * width, BLOCK_SIZE, KV_LORA_RANK + ROPE, dtype=DTYPE, device="cuda")
    return cache, block_tables


def bench_decode(batch: int, seq_len: int, iters: int, sweep: bool) -> dict:
    cache, block_tables = latent_cache(batch, seq_len)
    q_latent = torch.randn(batch, NUM_HEADS, KV_LORA_RANK, dtype=DTYPE, device="cuda")
    q_rope = torch.randn(batch, NUM_HEADS, ROPE, dtype=DTYPE, device="cuda")
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    scale = (NOPE + ROPE) ** -0.5
    args = (q_latent, q_rope, cache, block_tables, seq_lens, scale)
    fp8_cache = cache.to(FP8_DTYPE)
    us = {
        "triton": device_us(lambda: mla_decode_attention(*args), iters),
        "triton, e4m3 pool": device_us(
            lambda: mla_decode_attention(q_latent, q_rope, fp8_cache, block_tables, seq_lens, scale), iters),
        "torch": device_us(lambda: mla_decode_attention_reference(*args), iters),
    }
    if sweep:
        import triton

        from ops_cuda.mla_attention_triton import mla_decode_attention_triton

        out = torch.empty_like(q_latent)
        for block_h in (16, 32, 64):
            try:
                us[f"triton h{block_h}"] = device_us(
                    lambda: mla_decode_attention_triton(*args, out, block_h=block_h), iters)
            except triton.runtime.errors.OutOfResources as exc:  # a tile too large for this GPU's shared memory
                print(f"batch {batch}, {block_h} heads per program: {exc}", file=sys.stderr)
        for block_n in (32, 64):
            us[f"triton n{block_n}"] = device_us(
                lambda: mla_decode_attention_triton(*args, out, block_n=block_n), iters)
        for num_splits in (1, 2, 4, 8, 16, 32, 64):
            us[f"triton s{num_splits}"] = device_us(
                lambda: mla_decode_attention_triton(*args, out, num_splits=num_splits), iters)
    decompressed_bytes = batch * NUM_HEADS * seq_len * (NOPE + ROPE + V_DIM) * q_latent.element_size()
    if decompressed_bytes <= SDPA_MAX_BYTES:
        q = torch.randn(batch, NUM_HEADS, 1, NOPE + ROPE, dtype=DTYPE, device="cuda")
        keys = torch.randn(batch, NUM_HEADS, seq_len, NOPE + ROPE, dtype=DTYPE, device="cuda")
        values = torch.randn(batch, NUM_HEADS, seq_len, V_DIM, dtype=DTYPE, device="cuda")
        us["sdpa"] = device_us(lambda: F.scaled_dot_product_attention(q, keys, values, scale=scale), iters)
        del q, keys, values
    cache_bytes = batch * seq_len * (KV_LORA_RANK + ROPE) * q_latent.element_size()
    flops = 2 * batch * seq_len * NUM_HEADS * (KV_LORA_RANK + ROPE + KV_LORA_RANK)
    read = {k: cache_bytes // q_latent.element_size() if "e4m3" in k else cache_bytes for k in us}
    return {"batch": batch, "seq_len": seq_len, "cache_mb": cache_bytes / 1e6, "us": us,
            "cache_gb_s": {k: read[k] / (v * 1e-6) / 1e9 for k, v in us.items()},
            "tflop_s": {k: flops / (v * 1e-6) / 1e12 for k, v in us.items()}}


def bench_prefill(prompts: int, seq_len: int, iters: int, name: str, heads: int, nope: int, v_dim: int) -> dict:
    """``prompts`` new prompts of ``seq_len`` tokens, ragged as the runtime passes them, against SDPA
    on the same queries, keys and values as [prompts, heads, seq_len, dim] (the rope key repeated per
    head), causal."""
    tokens = prompts * seq_len
    q_nope, k_nope = (torch.randn(tokens, heads, nope, dtype=DTYPE, device="cuda") for _ in range(2))
    q_rope = torch.randn(tokens, heads, ROPE, dtype=DTYPE, device="cuda")
    k_rope = torch.randn(tokens, ROPE, dtype=DTYPE, device="cuda")
    v = torch.randn(tokens, heads, v_dim, dtype=DTYPE, device="cuda")
    starts = torch.arange(0, tokens + 1, seq_len, dtype=torch.int32, device="cuda")
    scale = (nope + ROPE) ** -0.5
    args = (q_nope, q_rope, k_nope, k_rope, v, starts, starts, seq_len)
    out = q_nope.new_empty(tokens, heads, v_dim)
    us = {"triton": graph_us(lambda: mla_prefill_attention_triton(*args, scale, out), iters)}
    if prefill_takes_flash(q_nope, q_rope, v):
        us["flash"] = graph_us(lambda: mla_prefill_attention(*args, seq_len, scale), iters)

    def heads_major(t):
        return t.view(prompts, seq_len, heads, t.shape[-1]).transpose(1, 2)

    q, k = (heads_major(t) for t in whole_heads(q_nope, q_rope, k_nope, k_rope))
    values = heads_major(v)
    us["sdpa"] = graph_us(lambda: F.scaled_dot_product_attention(q, k, values, is_causal=True, scale=scale), iters)
    flops = 2 * prompts * heads * seq_len * (seq_len + 1) / 2 * (nope + ROPE + v_dim)
    return {"shape": name, "heads": heads, "qk_head_dim": nope + ROPE, "v_head_dim": v_dim, "prompts": prompts,
            "seq_len": seq_len, "us": us, "tflop_s": {k: flops / (t * 1e-6) / 1e12 for k, t in us.items()}}


def prefill_markdown(row: dict) -> str:
    lines = ["", f"MLA prefill attention, {row['shape']} shape: {row['prompts']} new prompts of {row['seq_len']} "
             f"tokens, causal, {row['heads']} heads, qk head dim {row['qk_head_dim']}, v head dim {row['v_head_dim']}",
             "",
             "| kernel | µs | TFLOP/s |", "|---|---:|---:|"]
    lines += [f"| {kernel} | {us:.1f} | {row['tflop_s'][kernel]:.0f} |" for kernel, us in row["us"].items()]
    lines += ["", "triton: zoo's Triton kernel on the prompts' tokens as the runtime passes them (ragged); flash: "
              "zoo::mla_prefill_attention where it runs flash attention's variable-length form on them (k_rope "
              "repeated per head; where q/k and v heads are one width); sdpa: F.scaled_dot_product_attention on the "
              "same q/k/v as [prompts, heads, tokens, dim]."]
    return "\n".join(lines)


def markdown(rows: list[dict], bandwidth: float, header: str) -> str:
    lines = [header, "",
             f"HBM bandwidth measured here (4 GiB copy): {bandwidth / 1e12:.2f} TB/s; "
             f"spec {SPEC_BANDWIDTH / 1e12:.1f} TB/s",
             "",
             "| batch | context | bf16 latent cache MB | kernel | µs | cache GB/s | % measured | % spec | TFLOP/s |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        for kernel, us in r["us"].items():
            gb_s = r["cache_gb_s"][kernel]
            lines.append(f"| {r['batch']} | {r['seq_len']} | {r['cache_mb']:.0f} | {kernel} | {us:.1f} | {gb_s:.0f} | "
                         f"{100 * gb_s * 1e9 / bandwidth:.0f}% | {100 * gb_s * 1e9 / SPEC_BANDWIDTH:.0f}% | "
                         f"{r['tflop_s'][kernel]:.0f} |")
    lines += ["", "triton, e4m3 pool: the same kernel over the cache in float8_e4m3fn (its GB/s counts a byte "
              "an entry); torch: the torch backend's path (mla_decode_attention_reference: gather, einsums, softmax); "
              "sdpa: F.scaled_dot_product_attention on per-head K [192] / V [128] already decompressed "
              "(reads 128 x 320 x 2 bytes per token instead of 576 x 2; left out where they exceed "
              f"{SDPA_MAX_BYTES >> 30} GiB); its GB/s column still counts the latent bytes."]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--sweep", action="store_true",
                        help="also time 16, 32 and 64 heads per program, 32- and 64-key tiles and 1-64 splits")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mla.py needs a CUDA device")
    import triton

    torch.manual_seed(0)
    bandwidth = hbm_bandwidth()
    torch.cuda.empty_cache()
    rows = [bench_decode(batch, SEQ_LEN, args.iters, args.sweep) for batch in (1, 64, 256)]
    device = torch.cuda.get_device_name()
    header = (f"MLA decode attention, DeepSeek-V3 shape (H {NUM_HEADS}, latent {KV_LORA_RANK} + rope {ROPE}, bf16, "
              f"block {BLOCK_SIZE}) — {datetime.date.today()}, {device}, "
              f"torch {torch.__version__}, triton {triton.__version__}")
    print(markdown(rows, bandwidth, header))
    prefill = []
    for shape in PREFILL_SHAPES:
        torch.cuda.empty_cache()
        prefill.append(bench_prefill(PREFILL_PROMPTS, SEQ_LEN, args.iters, *shape))
        print(prefill_markdown(prefill[-1]))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "date": str(datetime.date.today()),
                                               "hbm_bandwidth": bandwidth, "decode": rows, "prefill": prefill},
                                              indent=2))


if __name__ == "__main__":
    main()
