import math, sys, inspect, statistics
sys.path.insert(0, ".")
import torch, triton
import torch.nn.functional as F
from benchmarks.bench_attention import paged_cache, device_ms, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
from ops_cuda.paged_attention_triton import _decode_split_kernel, _decode_reduce_kernel, NO_WINDOW
from ops_cuda.paged_attention import paged_prefill_attention
from ops_cuda.triton_kernels import pdl_launch

print(torch.__version__)
print(torch.ops.aten._flash_attention_forward.default._schema)
try:
    from torch.nn.attention import varlen
    print(inspect.signature(varlen.varlen_attn))
except Exception as e:
    print("no varlen", e)

def sweep(batch, seq_len):
    k_cache, v_cache, bt, keys, values = paged_cache(batch, seq_len)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * batch * seq_len * NUM_KV_HEADS * HEAD_DIM * 2
    ref = None
    for bn in (32, 64, 128):
        for warps in (2, 4, 8):
            for stages in (1, 2, 3, 4):
                for bh in (16,):
                    part_out = torch.empty(batch, NUM_HEADS, 1, HEAD_DIM, dtype=torch.float32, device="cuda")
                    part_lse = torch.empty(batch, NUM_HEADS, 1, dtype=torch.float32, device="cuda")
                    def run():
                        _decode_split_kernel[(batch, NUM_KV_HEADS, 1)](
                            q, k_cache, v_cache, bt, seq_lens, part_out, part_lse, HEAD_DIM**-0.5 * math.log2(math.e), NO_WINDOW,
                            q.stride(0), q.stride(1), bt.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
                            GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, NUM_SPLITS=1, BLOCK_H=bh, BLOCK_D=128, BLOCK_N=bn,
                            DOT_PRECISION="tf32", num_warps=warps, num_stages=stages, PDL=False, launch_pdl=False)
                    try:
                        ms = device_ms(run, 30)
                    except Exception as e:
                        print(f"bn {bn} w {warps} s {stages}: fail {type(e).__name__}")
                        continue
                    if ref is None:
                        ref = part_out.clone()
                    err = (part_out - ref).abs().max().item()
                    print(f"decode {batch}x{seq_len} bn {bn} w {warps} s {stages}: {ms*1e3:.1f} us {kv_bytes/ms/1e9:.0f} GB/s err {err:.1e}", flush=True)

sweep(450, 1500)
sweep(64, 4096)

# prefill: 8 prompts x 1024, paged kernel vs flash varlen
batch, L = 8, 1024
k_cache, v_cache, bt, keys, values = paged_cache(batch, L)
q = torch.randn(batch * L, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
fk = keys.transpose(1, 2).reshape(batch * L, NUM_KV_HEADS, HEAD_DIM).contiguous()
fv = values.transpose(1, 2).reshape(batch * L, NUM_KV_HEADS, HEAD_DIM).contiguous()
seq_lens = torch.full((batch,), L, dtype=torch.int32, device="cuda")
qsl = torch.arange(0, (batch + 1) * L, L, dtype=torch.int32, device="cuda")
args = (q, fk, fv, k_cache, v_cache, bt, seq_lens, qsl, L, HEAD_DIM**-0.5, 0)
flops = 2 * batch * NUM_HEADS * HEAD_DIM * L * L
ms = device_ms(lambda: paged_prefill_attention(*args), 30)
print(f"prefill paged triton: {ms:.3f} ms {flops/ms/1e9:.0f} TFLOP/s")
ours = paged_prefill_attention(*args)
def flash():
    return torch.ops.aten._flash_attention_forward(q, fk, fv, qsl, qsl, L, L, 0.0, True, False, scale=HEAD_DIM**-0.5)[0]
try:
    ms = device_ms(flash, 30)
    print(f"prefill flash varlen (aten, GQA): {ms:.3f} ms {flops/ms/1e9:.0f} TFLOP/s err {(flash()-ours).abs().max().item():.2e}")
except Exception as e:
    print("flash fail", e)
# flash with longer K than Q (context): last 512 queries of each seq over all 1024 keys
qq = q.view(batch, L, NUM_HEADS, HEAD_DIM)[:, 512:].reshape(-1, NUM_HEADS, HEAD_DIM).contiguous()
qsl2 = torch.arange(0, (batch + 1) * 512, 512, dtype=torch.int32, device="cuda")
try:
    o = torch.ops.aten._flash_attention_forward(qq, fk, fv, qsl2, qsl, 512, L, 0.0, True, False, scale=HEAD_DIM**-0.5)[0]
    print("bottom-right causal err", (o.view(batch, 512, NUM_HEADS, HEAD_DIM) - ours.view(batch, L, NUM_HEADS, HEAD_DIM)[:, 512:]).abs().max().item())
except Exception as e:
    print("flash ctx fail", e)
