"""Layer-by-layer diff of a zoo model against HuggingFace transformers on the same checkpoint.

Both models run the same input; forward hooks on the same module paths (embeddings; per layer
its input norm, attention, post-attention norm, MLP and output; final norm; logits) capture each
side's output. Where zoo fuses a residual add into the next norm, the hooked block reports
``(out, residual)`` and HuggingFace's view is rebuilt as their sum.
"""

from dataclasses import dataclass

import torch
from torch import nn

from loaders import load_tokenizer, resolve_source
from models import AutoModelForCausalLM

DEFAULT_PROMPT = "The capital of France is Paris, and the capital of Germany is"

# Defaults by dtype: a row passes when max_abs <= atol + rtol * max|reference|.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 5e-2), torch.bfloat16: (1e-2, 5e-2)}


@dataclass
class DiffRow:
    path: str
    shape: tuple[int, ...]
    max_abs: float
    relative: float
    cosine: float
    ok: bool


def load_reference(path_or_repo_id, dtype: torch.dtype, device):
    """HuggingFace transformers' model of the same checkpoint (never with remote code)."""
    import transformers

    source = resolve_source(path_or_repo_id)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(source.directory), gguf_file=source.gguf_file, dtype=dtype, trust_remote_code=False
    )
    return model.to(device).eval()


def tokenize(path_or_repo_id, prompt: str) -> torch.Tensor:
    tokenizer = load_tokenizer(path_or_repo_id)
    if tokenizer is None:
        raise ValueError(f"{resolve_source(path_or_repo_id).path}: no usable tokenizer; pass token ids instead of a prompt")
    return tokenizer(prompt, return_tensors="pt").input_ids


def compared_paths(model: nn.Module, reference: nn.Module) -> list[str]:
    """Block-level module paths present on both sides."""
    ours = dict(model.named_modules())
    theirs = dict(reference.named_modules())
    paths = ["model.embed_tokens"]
    for i, layer in enumerate(model.model.layers):
        paths += [f"model.layers.{i}.{child}" for child, _ in layer.named_children()]
        paths.append(f"model.layers.{i}")
    paths += ["model.norm", "lm_head"]
    return [p for p in paths if p in ours and p in theirs]


def _capture(model: nn.Module, paths: list[str], store: dict, hf_view: bool):
    handles = []
    for path in paths:
        module = model.get_submodule(path)

        def hook(mod, args, output, path=path):
            if isinstance(output, tuple):
                output = output[0] + output[1] if getattr(mod, "returns_residual", False) and not hf_view else output[0]
            store[path] = output.detach().float().cpu()

        handles.append(module.register_forward_hook(hook))
    return handles


@torch.no_grad()
def diff_models(model: nn.Module, reference: nn.Module, input_ids: torch.Tensor, atol=None, rtol=None) -> list[DiffRow]:
    """Run ``input_ids`` [B, T] through both models and compare each hooked module's output."""
    default_atol, default_rtol = TOLERANCES.get(next(model.parameters()).dtype, TOLERANCES[torch.bfloat16])
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    paths = compared_paths(model, reference)
    ours, theirs = {}, {}
    handles = _capture(model, paths, ours, hf_view=False) + _capture(reference, paths, theirs, hf_view=True)
    try:
        device = next(model.parameters()).device
        model(input_ids.to(device))
        reference(input_ids=input_ids.to(next(reference.parameters()).device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()

    rows = []
    for path in sorted(ours, key=list(ours).index):  # in the order zoo ran them
        a, b = ours[path], theirs[path]
        if a.numel() != b.numel():
            raise ValueError(f"{path}: zoo output has shape {tuple(a.shape)}, HuggingFace's {tuple(b.shape)}")
        a = a.reshape(b.shape).double()
        b = b.double()
        max_abs = (a - b).abs().max().item()
        ref_max = b.abs().max().item()
        cosine = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
        rows.append(DiffRow(path, tuple(b.shape), max_abs, max_abs / max(ref_max, 1e-30), cosine,
                            max_abs <= atol + rtol * ref_max))
    return rows


def diff_checkpoint(path_or_repo_id, input_ids=None, prompt=DEFAULT_PROMPT, dtype=torch.float32, device="cpu",
                    atol=None, rtol=None) -> list[DiffRow]:
    """Load zoo's and HuggingFace's model from one checkpoint and diff them layer by layer."""
    if input_ids is None:
        input_ids = tokenize(path_or_repo_id, prompt)
    model = AutoModelForCausalLM.from_pretrained(path_or_repo_id, dtype=dtype, device=device)
    reference = load_reference(path_or_repo_id, dtype, device)
    return diff_models(model, reference, input_ids, atol=atol, rtol=rtol)


def format_rows(rows: list[DiffRow]) -> str:
    """A table; the first row over tolerance is marked."""
    width = max(len(r.path) for r in rows)
    lines = [f"{'module':<{width}}  {'shape':<16} {'max abs diff':>12} {'rel diff':>10} {'cosine':>10}"]
    first_bad = next((r for r in rows if not r.ok), None)
    for r in rows:
        mark = "  <-- first over tolerance" if r is first_bad else ("  (over)" if not r.ok else "")
        lines.append(
            f"{r.path:<{width}}  {str(list(r.shape)):<16} {r.max_abs:>12.3e} {r.relative:>10.3e} {r.cosine:>10.7f}{mark}"
        )
    bad = sum(not r.ok for r in rows)
    lines.append(f"{len(rows)} modules compared, {bad} over tolerance" if bad else f"all {len(rows)} modules within tolerance")
    return "\n".join(lines)
