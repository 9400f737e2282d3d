import math, sys
sys.path.insert(0, ".")
import torch
import torch.nn.functional as F
from benchmarks.bench_attention import device_ms
from ops_cuda.paged_attention_triton import _decode_split_kernel, NO_WINDOW

H, HKV, D = 32, 8, 128
for lib in ("cublas", "cublaslt"):
    torch.backends.cuda.preferred_blas_library(lib)
    for m in (456, 8192):
        row = []
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
            a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ms = device_ms(lambda: F.linear(a, w), 20)
            row.append(f"{n}x{k}: {ms*1e3:.0f}us {2*m*n*k/ms/1e9:.0f}TF")
            del w, a
        print(f"{lib} M={m}: " + " | ".join(row), flush=True)
torch.backends.cuda.preferred_blas_library("cublas")

for batch in (64, 128, 256, 450):
    seq_len = 1500
    width = -(-seq_len // 16)
    bt = torch.randperm(batch * width, device="cuda").view(batch, width).to(torch.int32)
    k = torch.randn(batch * width, 16, HKV, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    q = torch.randn(batch, H, D, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    for bn in (32, 64):
        def run():
            _decode_split_kernel[(batch, HKV, 1)](
                q, k, v, bt, seq_lens, out, out, out, D**-0.5 * math.log2(math.e), NO_WINDOW,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1), bt.stride(0), *k.stride()[:3], *v.stride()[:3],
                GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, NUM_SPLITS=1, BLOCK_H=16, BLOCK_D=128, BLOCK_N=bn,
                DOT_PRECISION="tf32", num_warps=4, num_stages=2, PDL=False, launch_pdl=False)
        ms = device_ms(run, 30)
        print(f"decode {batch}x{seq_len} bn {bn}: {ms*1e3:.1f} us {2*batch*seq_len*HKV*D*2/ms/1e9:.2f} TB/s", flush=True)
    del k, v
