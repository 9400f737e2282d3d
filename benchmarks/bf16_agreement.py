"""bf16 agreement with HuggingFace on the GPU: top-1 agreement and KL over teacher-forced
positions, zoo vs HF (sdpa), next to how far HF moves from itself under changes that are not
errors, and how close each bf16 run is to HF in float32.

Columns, each a top-1 agreement over the same positions:
- zoo vs HF: zoo's bf16 model (its Triton kernels) against HF's bf16 sdpa path;
- zoo, PyTorch ops: the same with the PyTorch references of zoo's ops instead of the Triton
  kernels (the references follow HF operation for operation), so what is left is the matrix
  products and attention;
- HF eager vs sdpa: HF's two attention paths on the same weights;
- HF one at a time vs batched: HF's sdpa path on each sequence alone against the batch (cuBLAS
  picks other kernels for other shapes);
- zoo vs f32, HF vs f32: each bf16 run against HF in float32.

    python3 benchmarks/bf16_agreement.py

On a machine without CUDA it runs on the CPU, where zoo's ops are their PyTorch references.
"""

import contextlib
import copy
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import layers.attention  # noqa: E402
import layers.mlp  # noqa: E402
import layers.norm  # noqa: E402
from models import AutoModelForCausalLM  # noqa: E402
from ops_cuda.activation import act_and_mul_reference  # noqa: E402
from ops_cuda.norm import fused_add_rms_norm_reference, rms_norm_reference  # noqa: E402
from ops_cuda.rotary import apply_rotary_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def compare(a, b):
    a, b = a.float(), b.float()
    agreement = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    return agreement, kl.mean().item()


@contextlib.contextmanager
def pytorch_ops():
    """The layers call the references of their ops where they would call the Triton kernels."""
    names = [(layers.norm, "fused_add_rms_norm", fused_add_rms_norm_reference),
             (layers.norm, "rms_norm", rms_norm_reference), (layers.attention, "apply_rotary", apply_rotary_reference),
             (layers.mlp, "act_and_mul", act_and_mul_reference)]
    saved = [getattr(module, name) for module, name, _ in names]
    for module, name, reference in names:
        setattr(module, name, reference)
    try:
        yield
    finally:
        for (module, name, _), original in zip(names, saved):
            setattr(module, name, original)


def in_float32(model):
    # A copy cast parameter by parameter: HF refuses .float() on a model loaded from a GGUF file.
    copied = copy.deepcopy(model)
    for tensor in [*copied.parameters(), *copied.buffers()]:
        if tensor.is_floating_point():
            tensor.data = tensor.data.float()
    return copied


@torch.no_grad()
def report(name, reference, input_ids):
    model = AutoModelForCausalLM.from_hf(reference)
    reference.config._attn_implementation = "sdpa"
    sdpa = reference(input_ids).logits
    one_at_a_time = torch.cat([reference(row[None]).logits for row in input_ids])
    reference.config._attn_implementation = "eager"
    eager = reference(input_ids).logits
    reference.config._attn_implementation = "sdpa"
    ours = model(input_ids)
    with pytorch_ops():
        ours_pytorch_ops = model(input_ids)
    float32 = in_float32(reference)(input_ids).logits
    z, zk = compare(ours, sdpa)
    p, _ = compare(ours_pytorch_ops, sdpa)
    h, hk = compare(eager, sdpa)
    b, _ = compare(one_at_a_time, sdpa)
    zf, _ = compare(ours, float32)
    hf, _ = compare(sdpa, float32)
    print(f"| {name} | {z:.2%} | {zk:.1e} | {p:.2%} | {h:.2%} | {hk:.1e} | {b:.2%} | {zf:.2%} | {hf:.2%} |", flush=True)


def main():
    print("| model (bf16, 256 teacher-forced positions) | zoo vs HF | zoo vs HF KL | zoo, PyTorch ops, vs HF "
          "| HF eager vs sdpa | HF eager vs sdpa KL | HF one at a time vs batched | zoo vs f32 | HF vs f32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    small = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(1)
    random_ids = torch.randint(0, 4096, (2, 128), device=DEVICE)
    # Two random regimes: HF's init (std 0.02) gives nearly flat logits, where bf16 rounding decides
    # close argmaxes; the CPU tests' wider init (std 0.15) gives large activations, where rounding
    # compounds over the layers.
    for model_type in ("llama", "qwen3"):
        for init_std in (None, 0.15):
            torch.manual_seed(0)
            config = transformers.AutoConfig.for_model(model_type, **small)
            if init_std is not None:
                config.initializer_range = init_std
            with torch.device(DEVICE):
                reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
            init = "HF init" if init_std is None else f"init std {init_std}"
            report(f"random {model_type} ({init})", reference, random_ids)
    from loaders.default_model import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError:
        return
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                 dtype=torch.bfloat16).to(DEVICE).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = Path(__file__).read_text() + Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :512].reshape(2, 256).to(DEVICE)
    report("SmolLM2-135M-Instruct (real weights)", reference, ids)


if __name__ == "__main__":
    main()
