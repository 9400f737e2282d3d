"""RMSNorm: the Triton kernel and variants of its statistics against the PyTorch reference (F.rms_norm
in float32), element mismatches in bf16 over widths zoo's models use."""
import sys, torch, triton, triton.language as tl
from triton.language.extra import libdevice
sys.path.insert(0, ".")
from ops_cuda.norm import rms_norm_reference, fused_add_rms_norm_reference
from ops_cuda.triton_kernels import rms_norm_triton, fused_add_rms_norm_triton
from ops_cuda.activation import act_and_mul_reference
from ops_cuda.triton_kernels import act_and_mul_triton

@triton.jit
def rmsnorm(x_ptr, w_ptr, out_ptr, hidden, eps, VARIANT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    if VARIANT == 0:
        r = tl.math.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    elif VARIANT == 1:
        r = tl.math.rsqrt(tl.sum(x * x, axis=0) * (1.0 / hidden) + eps)
    elif VARIANT == 2:
        r = libdevice.rsqrt(tl.math.div_rn(tl.sum(x * x, axis=0), hidden * 1.0) + eps)
    else:
        r = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(tl.sum(x * x, axis=0), hidden * 1.0) + eps))
    n = (x * r).to(tl.bfloat16).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (n * w).to(tl.bfloat16), mask=mask)

torch.manual_seed(0)
for hidden in (64, 128, 576, 896, 2048, 4096, 5120):
    x = (torch.randn(4096, hidden, device="cuda") * 3).bfloat16()
    w = (torch.rand(hidden, device="cuda") + 0.5).bfloat16()
    ref = rms_norm_reference(x, w, 1e-5)
    line = [f"hidden {hidden}: kernel {(rms_norm_triton(x, w, 1e-5) != ref).sum().item()}"]
    res = torch.randn_like(x)
    line.append(f"fused-add kernel {(fused_add_rms_norm_triton(x, res, w, 1e-5)[0] != fused_add_rms_norm_reference(x, res, w, 1e-5)[0]).sum().item()}")
    for v, name in enumerate(["/N rsqrt", "*1/N rsqrt", "div_rn libdevice rsqrt", "div_rn 1/sqrt_rn"]):
        out = torch.empty_like(ref)
        rmsnorm[(4096,)](x, w, out, hidden, 1e-5, VARIANT=v, BLOCK=triton.next_power_of_2(hidden))
        line.append(f"{name} {(out != ref).sum().item()}")
    print("; ".join(line), f"of {ref.numel()}")
for d in (1536, 4864, 14336):
    x = (torch.randn(1024, 2 * d, device="cuda") * 2).bfloat16()
    print(f"act_and_mul d={d}: kernel mismatches {(act_and_mul_triton(x, 'silu') != act_and_mul_reference(x, 'silu')).sum().item()}")
