"""Which Triton kernel moves zoo's bf16 logits off HF's: per-op mismatch counts against the PyTorch
reference, kernel variants with IEEE division and libdevice exp/rsqrt, and top-1 agreement with
one op at a time swapped for its reference."""
import contextlib, sys, torch, transformers, triton, triton.language as tl
from triton.language.extra import libdevice
sys.path.insert(0, ".")
import layers.attention, layers.mlp, layers.norm
from loaders.in_memory import model_from_hf
from ops_cuda.activation import act_and_mul_reference
from ops_cuda.norm import fused_add_rms_norm_reference, rms_norm_reference
from ops_cuda.rotary import apply_rotary_reference
from ops_cuda.triton_kernels import act_and_mul_triton, rms_norm_triton, fused_add_rms_norm_triton

@triton.jit
def silu_mul(x_ptr, out_ptr, d, VARIANT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * 2 * d + cols, mask=mask).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * d + d + cols, mask=mask).to(tl.float32)
    if VARIANT == 0:
        a = g / (1.0 + tl.exp(-g))
    elif VARIANT == 1:
        a = tl.math.div_rn(g, 1.0 + tl.exp(-g))
    elif VARIANT == 2:
        a = g / (1.0 + libdevice.exp(-g))
    else:
        a = tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
    out = a.to(tl.bfloat16).to(tl.float32) * u
    tl.store(out_ptr + row * d + cols, out.to(tl.bfloat16), mask=mask)

@triton.jit
def rmsnorm(x_ptr, w_ptr, out_ptr, hidden, eps, VARIANT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    if VARIANT == 0:
        var = tl.sum(x * x, axis=0) / hidden
        r = tl.math.rsqrt(var + eps)
    elif VARIANT == 1:
        var = tl.math.div_rn(tl.sum(x * x, axis=0), hidden * 1.0)
        r = tl.math.rsqrt(var + eps)
    elif VARIANT == 2:
        var = tl.math.div_rn(tl.sum(x * x, axis=0), hidden * 1.0)
        r = libdevice.rsqrt(var + eps)
    else:
        var = tl.sum(x * x, axis=0) * (1.0 / hidden)
        r = libdevice.rsqrt(var + eps)
    n = (x * r).to(tl.bfloat16).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (n * w).to(tl.bfloat16), mask=mask)

def hf_rms(x, w, eps):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

torch.manual_seed(0)
for d in (1408, 14336):
    x = (torch.randn(512, 2 * d, device="cuda") * 2).bfloat16()
    ref = act_and_mul_reference(x, "silu")
    print(f"act_and_mul d={d}: zoo kernel mismatches {(act_and_mul_triton(x, 'silu') != ref).sum().item()} of {ref.numel()}")
    for v, name in enumerate(["exp, /", "exp, div_rn", "libdevice exp, /", "libdevice exp, div_rn"]):
        out = torch.empty_like(ref)
        silu_mul[(512, triton.cdiv(d, 1024))](x, out, d, VARIANT=v, BLOCK=1024)
        print(f"   variant {name}: mismatches {(out != ref).sum().item()}")
for hidden in (128, 512, 4096):
    x = (torch.randn(2048, hidden, device="cuda") * 3).bfloat16()
    w = (torch.rand(hidden, device="cuda") + 0.5).bfloat16()
    hf = hf_rms(x, w, 1e-6)
    ref = rms_norm_reference(x, w, 1e-6)
    print(f"rms_norm hidden={hidden}: reference vs HF mismatches {(ref != hf).sum().item()}, zoo kernel vs HF {(rms_norm_triton(x, w, 1e-6) != hf).sum().item()} of {hf.numel()}")
    for v, name in enumerate(["/ N, rsqrt", "div_rn N, rsqrt", "div_rn N, libdevice rsqrt", "* 1/N, libdevice rsqrt"]):
        out = torch.empty_like(hf)
        rmsnorm[(2048,)](x, w, out, hidden, 1e-6, VARIANT=v, BLOCK=triton.next_power_of_2(hidden))
        print(f"   variant {name}: mismatches vs HF {(out != hf).sum().item()}")

def agree(a, b):
    return (a.float().argmax(-1) == b.float().argmax(-1)).float().mean().item()
OPS = {"norms": [(layers.norm, "fused_add_rms_norm", fused_add_rms_norm_reference), (layers.norm, "rms_norm", rms_norm_reference)],
       "rotary": [(layers.attention, "apply_rotary", apply_rotary_reference)],
       "act_and_mul": [(layers.mlp, "act_and_mul", act_and_mul_reference)]}
@contextlib.contextmanager
def swapped(entries):
    saved = [getattr(m, n) for m, n, _ in entries]
    for m, n, r in entries: setattr(m, n, r)
    try: yield
    finally:
        for (m, n, _), s in zip(entries, saved): setattr(m, n, s)
small = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=2048)
torch.manual_seed(1)
ids = torch.randint(0, 4096, (2, 128), device="cuda")
with torch.no_grad():
    for mt in ("llama", "qwen3"):
        torch.manual_seed(0)
        with torch.device("cuda"):
            ref = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(mt, **small), dtype=torch.bfloat16).eval()
        ref.config._attn_implementation = "sdpa"
        hf = ref(ids).logits
        model = model_from_hf(ref)
        row = [f"kernels {agree(model(ids), hf):.2%}"]
        for name, entries in OPS.items():
            with swapped(entries):
                row.append(f"{name} as reference {agree(model(ids), hf):.2%}")
        print(mt, "; ".join(row))
