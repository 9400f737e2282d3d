import math, sys
sys.path.insert(0, ".")
import torch
import torch.nn.functional as F
from benchmarks.bench_attention import device_ms
from ops_cuda.paged_attention_triton import _decode_split_kernel, NO_WINDOW

H, HKV, D = 32, 8, 128

def cache(batch, seq_len, bs, layout):
    width = -(-seq_len // bs)
    bt = torch.randperm(batch * width, device="cuda").view(batch, width).to(torch.int32)
    shape = (batch * width, bs, HKV, D) if layout == "NHD" else (batch * width, HKV, bs, D)
    k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    return k, v, bt

def strides(c, layout):
    s = c.stride()
    return (s[0], s[1], s[2]) if layout == "NHD" else (s[0], s[2], s[1])

def run_case(batch, seq_len, bs, layout, bn, warps, stages, q, out):
    k, v, bt = cache(batch, seq_len, bs, layout)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    def run():
        _decode_split_kernel[(batch, HKV, 1)](
            q, k, v, bt, seq_lens, out, out, out, D**-0.5 * math.log2(math.e), NO_WINDOW,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), bt.stride(0), *strides(k, layout), *strides(v, layout),
            GROUP=4, HEAD_DIM=128, BLOCK_SIZE=bs, NUM_SPLITS=1, BLOCK_H=16, BLOCK_D=128, BLOCK_N=bn,
            DOT_PRECISION="tf32", num_warps=warps, num_stages=stages, PDL=False, launch_pdl=False)
    ms = device_ms(run, 30)
    kv_bytes = 2 * batch * seq_len * HKV * D * 2
    print(f"decode {batch}x{seq_len} {layout} bs {bs} bn {bn} w {warps} s {stages}: {ms*1e3:.1f} us {kv_bytes/ms/1e9:.2f} TB/s", flush=True)
    del k, v

for batch, seq_len in ((450, 1500),):
    q = torch.randn(batch, H, D, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    for layout in ("NHD", "HND"):
        for bs in (16, 32, 64):
            for bn in (32, 64, 128):
                if bn < bs and layout == "HND":
                    pass
                for warps, stages in ((4, 2), (4, 3), (2, 3)):
                    try:
                        run_case(batch, seq_len, bs, layout, bn, warps, stages, q, out)
                    except Exception as e:
                        print(layout, bs, bn, warps, stages, "fail", type(e).__name__, str(e)[:100])

# read-only bandwidth references
x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
ms = device_ms(lambda: x.view(torch.bfloat16).sum(), 20)
print(f"sum 4 GiB: {4*(1<<30)/ms/1e9:.2f} TB/s")
# GEMM tile quantization at decode batch sizes
for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
    row = []
    for m in (384, 448, 456, 464, 480, 512):
        a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        ms = device_ms(lambda: F.linear(a, w), 30)
        row.append(f"M={m}: {ms*1e3:.0f}us {2*m*n*k/ms/1e9:.0f}TF")
    print(f"linear N={n} K={k}: " + " | ".join(row), flush=True)
