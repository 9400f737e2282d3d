"""Is the Triton rotary kernel bit-equal to its PyTorch reference in bf16? Where not, which elements."""
import sys, torch
sys.path.insert(0, ".")
from ops_cuda.rotary import apply_rotary_reference
from ops_cuda.triton_kernels import apply_rotary_triton
torch.manual_seed(0)
n, hq, hk, d = 256, 8, 2, 64
for dtype in (torch.bfloat16, torch.float16):
    qkv = torch.randn(n, (hq + 2 * hk) * d, device="cuda", dtype=dtype)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], -1)
    q, k = q.view(n, hq, d), k.view(n, hk, d)
    pos = torch.arange(128, device="cuda").repeat(2)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device="cuda") / d))
    freqs = pos[:, None].float() * inv
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    tq, tk = apply_rotary_triton(q, k, cos, sin)
    rq, rk = apply_rotary_reference(q, k, cos, sin)
    for name, a, b, x in (("q", tq, rq, q), ("k", tk, rk, k)):
        bad = (a != b).nonzero()
        print(dtype, name, "mismatches", len(bad), "of", a.numel())
        for t, h, c in bad[:6].tolist():
            half = d // 2
            i = c % half
            x1, x2 = x[t, h, i].float().item(), x[t, h, i + half].float().item()
            cs, sn = cos[t, c].to(dtype).float().item(), sin[t, c].to(dtype).float().item()
            print(f"  t={t} h={h} c={c}: x1={x1!r} x2={x2!r} cos={cs!r} sin={sn!r} triton={a[t,h,c].float().item()!r} ref={b[t,h,c].float().item()!r}")
    # The same products and sums done by torch in float32 with explicit rounding
    c16, s16 = cos.to(dtype)[:, None], sin.to(dtype)[:, None]
    x1, x2 = q[..., :d // 2].float(), q[..., d // 2:].float()
    a = (x1 * c16[..., :d // 2].float()).to(dtype).float() - (x2 * s16[..., :d // 2].float()).to(dtype).float()
    print("  emulated first half vs reference mismatches", (a.to(dtype) != rq[..., :d // 2]).sum().item())
