"""Whether a decode step gains from running its memory-bound attention beside its compute-bound
matrix products, on one GPU.

A large-batch decode step of the Llama-3.1-8B shape spends most of its time in two kinds of kernel:
decode attention, bound by reading the K/V cache, and the four products of each layer (qkv_proj,
o_proj, gate_up_proj, down_proj on cuBLAS), bound by the tensor cores. Overlapped perfectly, a step
would take the longer of the two instead of their sum. This times, over 4 layers' weights (so the
products read from HBM) and sequences of 1,536 tokens:

- the whole batch's attention, then its products, in sequence (what zoo's decode step does);
- the batch split in two halves on two CUDA streams, one half's attention beside the other half's
  products, then the other way round: the same work, in two micro-batches that could overlap;
- one half's attention beside the other half's products, against the two in sequence.

Rows: 450 sequences over a bf16 cache and 900 over an e4m3 cache, the two 1000/1000 throughput
runs of ``bench_gpu.py --task throughput-8b``. Each case is one CUDA graph, median of 10 replays.

    python3 benchmarks/bench_overlap.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import DTYPE, HEAD_DIM, NUM_HEADS, paged_cache  # noqa: E402
from bench_gpu import graph_us  # noqa: E402
from ops_cuda.fp8 import FP8_DTYPE  # noqa: E402
from ops_cuda.kv_cache import quantize  # noqa: E402
from ops_cuda.paged_attention import paged_decode_attention  # noqa: E402

LAYERS, SEQ_LEN, REPLAYS = 4, 1536, 10
# (out features, in features) of one layer's products: qkv_proj, o_proj, gate_up_proj, down_proj
PRODUCTS = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))


def beside(first, second, side: torch.cuda.Stream):
    """first() on the current stream while second() runs on ``side``; both done on return."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        second()
    first()
    torch.cuda.current_stream().wait_stream(side)


def measure(batch: int, cache_dtype: torch.dtype) -> str:
    half = batch // 2
    weights = [[torch.randn(shape, dtype=DTYPE, device="cuda") * 0.02 for shape in PRODUCTS] for _ in range(LAYERS)]
    inputs = {rows: (torch.randn(rows, 4096, dtype=DTYPE, device="cuda"), torch.randn(rows, 14336, dtype=DTYPE, device="cuda"))
              for rows in (half, batch)}
    halves = []
    for _ in range(2):
        k_cache, v_cache, block_tables, _, _ = paged_cache(half, SEQ_LEN)
        if cache_dtype == FP8_DTYPE:
            k_cache, v_cache = quantize(k_cache, 1.0, FP8_DTYPE), quantize(v_cache, 1.0, FP8_DTYPE)
        q = torch.randn(half, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        seq_lens = torch.full((half,), SEQ_LEN, dtype=torch.int32, device="cuda")
        halves.append((q, k_cache, v_cache, block_tables, seq_lens))

    def attention(*which):
        for _ in range(LAYERS):
            for index in which:
                paged_decode_attention(*halves[index], HEAD_DIM**-0.5, 0)

    def products(rows):
        x, h = inputs[rows]
        for qkv, o, gate_up, down in weights:
            for weight, row in ((qkv, x), (o, x), (gate_up, x), (down, h)):
                torch.mm(row, weight.t())

    def graph_ms(fn):
        return graph_us(fn, REPLAYS) / 1e3

    side = torch.cuda.Stream()
    whole_attention, whole_products = graph_ms(lambda: attention(0, 1)), graph_ms(lambda: products(batch))
    half_attention, half_products = graph_ms(lambda: attention(0)), graph_ms(lambda: products(half))

    def micro_batches():
        beside(lambda: attention(0), lambda: products(half), side)
        beside(lambda: products(half), lambda: attention(1), side)

    two_halves = graph_ms(micro_batches)
    one_pair = graph_ms(lambda: beside(lambda: attention(0), lambda: products(half), side))
    name = "bf16" if cache_dtype == DTYPE else "e4m3"
    return (f"| {batch} x {SEQ_LEN}, {name} cache | {whole_attention:.2f} | {whole_products:.2f} | "
            f"{whole_attention + whole_products:.2f} | {two_halves:.2f} | {half_attention + half_products:.2f} | "
            f"{one_pair:.2f} |")


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms for {LAYERS} layers")
    print("| batch | attention | products | in sequence | two micro-batches on two streams "
          "| half: attention + products in sequence | half: on two streams |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for batch, cache_dtype in ((450, DTYPE), (900, FP8_DTYPE)):
        print(measure(batch, cache_dtype), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
