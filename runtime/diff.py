"""Layer-by-layer diff of a zoo model against HuggingFace transformers on the same checkpoint.

Both models run the same input; forward hooks on the same module paths (embeddings; per layer
its input norm, attention, post-attention norm, MLP and output; final norm; LM head) and on the
models themselves (the logits they return) capture each side's output. Where zoo fuses a residual
add into the next norm, the hooked block reports ``(out, residual)`` and HuggingFace's view is
rebuilt as their sum. zoo's norms run unsplit here (``models.base.norms_unsplit``): a single-row
step would otherwise leave o_proj's and down_proj's products to the norms after them.

``diff_models`` runs one cache-free forward on each side. ``diff_runtime`` runs zoo's runtime path
instead (``LLM``: a prefill through the paged KV cache, then greedy decode steps) and HuggingFace
with its own cache on the same tokens, and compares every step.
"""

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from loaders import from_checkpoint, load_config, load_processor, load_tokenizer, resolve_source
from models import AutoModelForCausalLM
from models.base import check_batch, norms_unsplit
from runtime import LLM, SamplingParams
from runtime.sampling_params import is_finite_number, is_integer

DEFAULT_PROMPT = "The capital of France is Paris, and the capital of Germany is"
DEFAULT_STEPS = 4

# The row of the logits a model returns (after the LM head and anything a model applies to them).
LOGITS = "logits"

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
    takes_images = getattr(load_config(source), "vision_config", None) is not None  # LLaVA's kind
    auto_class = transformers.AutoModelForImageTextToText if takes_images else transformers.AutoModelForCausalLM
    model = from_checkpoint(auto_class, source, dtype=dtype)
    return model.to(device).eval()


def tokenize(path_or_repo_id, prompt: str) -> torch.Tensor:
    tokenizer = load_tokenizer(path_or_repo_id)
    if tokenizer is None:
        raise ValueError(f"{resolve_source(path_or_repo_id).path}: no usable tokenizer; pass token ids instead of a prompt")
    return tokenizer(prompt, return_tensors="pt").input_ids


def compared_paths(model: nn.Module, reference: nn.Module) -> list[str]:
    """Block-level module paths present on both sides, then the returned logits: a LLaVA model's
    vision tower (embeddings, pre-norm, each encoder layer and its children) and projector, then
    the decoder (``model`` or LLaVA's ``model.language_model``): embeddings, each layer and its
    children, final norm; the LM head."""
    ours = dict(model.named_modules())
    theirs = dict(reference.named_modules())
    paths = []
    tower = "model.vision_tower"
    if tower in ours:
        paths += [f"{tower}.embeddings", f"{tower}.pre_layrnorm"]
        paths += block_paths(f"{tower}.encoder.layers", ours)
        paths.append("model.multi_modal_projector")
    decoder = "model.language_model" if "model.language_model" in ours else "model"
    paths += [f"{decoder}.embed_tokens", *block_paths(f"{decoder}.layers", ours), f"{decoder}.norm", "lm_head"]
    return [p for p in paths if p in ours and p in theirs] + [LOGITS]


def block_paths(stack: str, modules: dict[str, nn.Module]) -> list[str]:
    """Each layer of the ModuleList at ``stack``: its children, then the layer itself."""
    paths = []
    for i, layer in enumerate(modules[stack]):
        paths += [f"{stack}.{i}.{child}" for child, _ in layer.named_children()] + [f"{stack}.{i}"]
    return paths


def _capture(model: nn.Module, paths: list[str], steps: list[dict], hf_view: bool):
    """Hooks that record, per forward of ``model``, each path's output into a new dict of ``steps``."""

    def start_step(mod, args):
        steps.append({})

    handles = [model.register_forward_pre_hook(start_step)]
    for path in paths:
        module = model if path == LOGITS else model.get_submodule(path)

        def hook(mod, args, output, path=path):
            if path == LOGITS:
                output = getattr(output, "logits", output)  # HuggingFace returns a ModelOutput
            elif isinstance(output, tuple):
                output = output[0] + output[1] if getattr(mod, "returns_residual", False) and not hf_view else output[0]
            steps[-1][path] = output.detach().float().cpu()

        handles.append(module.register_forward_hook(hook))
    return handles


def _tolerances(model: nn.Module, atol, rtol) -> tuple[float, float]:
    default_atol, default_rtol = TOLERANCES.get(next(model.parameters()).dtype, TOLERANCES[torch.bfloat16])
    return default_atol if atol is None else atol, default_rtol if rtol is None else rtol


def _compare(ours: dict, theirs: dict, atol: float, rtol: float, label: str = "") -> list[DiffRow]:
    rows = []
    for path in ours:  # in the order zoo ran them
        a, b = ours[path], theirs[path]
        if a.numel() != b.numel():
            raise ValueError(f"{label}{path}: zoo output has shape {tuple(a.shape)}, HuggingFace's {tuple(b.shape)}")
        a = a.reshape(b.shape).double()
        b = b.double()
        max_abs = (a - b).abs().max().item()
        ref_max = b.abs().max().item()
        cosine = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
        rows.append(DiffRow(label + path, tuple(b.shape), max_abs, max_abs / max(ref_max, 1e-30), cosine,
                            max_abs <= atol + rtol * ref_max))
    return rows


@torch.no_grad()
def diff_models(model: nn.Module, reference: nn.Module, input_ids: torch.Tensor, atol=None, rtol=None,
                **image_inputs) -> list[DiffRow]:
    """Run ``input_ids`` [B, T] through both models and compare each hooked module's output.
    ``image_inputs``: the images a LLaVA model takes with them (``pixel_values``, ``image_sizes``)."""
    atol, rtol = _tolerances(model, atol, rtol)
    paths = compared_paths(model, reference)
    ours, theirs = [], []
    handles = _capture(model, paths, ours, hf_view=False) + _capture(reference, paths, theirs, hf_view=True)

    def on_device_of(module):
        device = next(module.parameters()).device
        return {name: value.to(device) if isinstance(value, torch.Tensor) else value
                for name, value in dict(image_inputs, input_ids=input_ids).items()}

    try:
        with norms_unsplit(model):
            model(**on_device_of(model))
        reference(**on_device_of(reference), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return _compare(ours[0], theirs[0], atol, rtol)


@torch.no_grad()
def diff_runtime(model: nn.Module, reference: nn.Module, input_ids: torch.Tensor, steps: int = DEFAULT_STEPS,
                 atol=None, rtol=None) -> list[DiffRow]:
    """Run the prompt ``input_ids`` [1, T] through zoo's runtime (``LLM``, eager so that hooks fire:
    a prefill through the paged KV cache, then ``steps`` greedy decode steps) and through
    HuggingFace with its cache (the prefill, then one token at a time on zoo's tokens); compare
    the prefill's rows, then each decode step's. The runtime computes logits only for the last
    token of the prefill: its LM head and logits rows compare with HuggingFace's last position.
    The LLM binds its KV cache to ``model``'s layers (see ``LLM``)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"the runtime diff takes one prompt, input_ids [1, T]; got shape {tuple(input_ids.shape)}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    text_config = model.config.get_text_config()
    # The cache-free forward's check: the LLM would only fail the request, HuggingFace's embedding raise an IndexError.
    check_batch(input_ids, text_config.vocab_size)
    atol, rtol = _tolerances(model, atol, rtol)
    prompt = input_ids[0].tolist()
    max_model_len = len(prompt) + steps + 1
    if max_model_len > text_config.max_position_embeddings:  # the LLM's limit: it would run no forward at all
        raise ValueError(f"a prompt of {len(prompt)} tokens, {steps} decode steps and the token the last samples "
                         f"take {max_model_len} positions; the model's max_position_embeddings is "
                         f"{text_config.max_position_embeddings}")
    block_size = 16
    llm = LLM(model, enforce_eager=True, max_num_seqs=1, max_model_len=max_model_len, block_size=block_size,
              num_blocks=-(-max_model_len // block_size), enable_chunked_prefill=False, enable_prefix_caching=False)
    paths = compared_paths(model, reference)
    ours, theirs = [], []
    handles = _capture(model, paths, ours, hf_view=False) + _capture(reference, paths, theirs, hf_view=True)
    try:
        # The prefill samples the first token; each decode step feeds one and samples the next.
        params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
        with norms_unsplit(model):
            tokens = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
        device = next(reference.parameters()).device
        cache_name = _cache_name(reference)
        cache = getattr(reference(input_ids=input_ids.to(device), use_cache=True), cache_name)
        for token in tokens[:steps]:
            output = reference(input_ids=torch.tensor([[token]], device=device), use_cache=True, **{cache_name: cache})
            cache = getattr(output, cache_name)
    finally:
        for handle in handles:
            handle.remove()
    if len(ours) != steps + 1:
        raise RuntimeError(f"the runtime ran {len(ours)} forwards for a prefill and {steps} decode steps")
    for path in ("lm_head", LOGITS):
        if path in theirs[0]:
            theirs[0][path] = theirs[0][path][:, -1:]
    rows = []
    for step, (zoo_step, hf_step) in enumerate(zip(ours, theirs)):
        rows += _compare(zoo_step, hf_step, atol, rtol, label="prefill/" if step == 0 else f"decode {step}/")
    return rows


def _cache_name(reference: nn.Module) -> str:
    """The name of HuggingFace's KV cache, in its forward's arguments and in its output: ``cache``
    from transformers 5.24 on, ``past_key_values`` before (5.40 drops the old name)."""
    return "cache" if "cache" in inspect.signature(reference.forward).parameters else "past_key_values"


def diff_checkpoint(path_or_repo_id, input_ids=None, prompt=DEFAULT_PROMPT, dtype=torch.float32, device="cpu",
                    atol=None, rtol=None, runtime_steps: int | None = None, images=None) -> list[DiffRow]:
    """Load zoo's and HuggingFace's model from one checkpoint and diff them layer by layer: one
    cache-free forward, or with ``runtime_steps``, the runtime's prefill and that many decode steps.
    ``images`` (PIL images, for LLaVA) go with ``prompt`` through the checkpoint's processor, in the
    prompt's ``<image>`` placeholders, or before the prompt where it has none; the cache-free
    forward takes them."""
    if runtime_steps is not None and not (is_integer(runtime_steps) and runtime_steps >= 1):
        raise ValueError(f"runtime_steps must be None or an integer >= 1, got {runtime_steps!r}")
    for name, value in (("atol", atol), ("rtol", rtol)):
        if value is not None and not (is_finite_number(value) and value >= 0):
            raise ValueError(f"{name} must be None or a finite number >= 0, got {value!r}")
    if input_ids is None and not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string where no input_ids are given, got {type(prompt).__name__}")
    if input_ids is not None and not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch tensor of token ids, got {type(input_ids).__name__}")
    load_config(resolve_source(path_or_repo_id))  # a path that holds no checkpoint is named as such first
    image_inputs = {}
    if images:
        if input_ids is not None or runtime_steps is not None:
            raise ValueError("images go with a prompt (not token ids) through the cache-free forward (not the runtime's)")
        input_ids, image_inputs = process_images(path_or_repo_id, prompt, images)
    elif input_ids is None:
        input_ids = tokenize(path_or_repo_id, prompt)
    model = AutoModelForCausalLM.from_pretrained(path_or_repo_id, dtype=dtype, device=device)
    image_token = getattr(model, "image_token_id", None)
    placeholders = 0 if image_token is None or image_inputs else int((input_ids == image_token).sum())
    if placeholders:  # HF would embed them as text tokens; no run of zoo's takes them without images
        raise ValueError(f"the input holds {placeholders} image placeholders (id {image_token}) and no image: "
                         "give the images (zoo diff --image)")
    reference = load_reference(path_or_repo_id, dtype, device)
    if runtime_steps is None:
        return diff_models(model, reference, input_ids, atol=atol, rtol=rtol, **image_inputs)
    return diff_runtime(model, reference, input_ids, runtime_steps, atol=atol, rtol=rtol)


def process_images(path_or_repo_id, prompt: str, images: list) -> tuple[torch.Tensor, dict]:
    """The input ids [1, T], placeholders expanded, and the image tensors of the prompt and images."""
    processor = load_processor(path_or_repo_id)
    if processor is None:
        raise ValueError(f"{resolve_source(path_or_repo_id).path}: no image processor, so no images")
    if processor.image_token not in prompt:
        prompt = f"{processor.image_token}\n" * len(images) + prompt
    batch = processor(text=prompt, images=images, return_tensors="pt")
    return batch["input_ids"], {name: batch[name] for name in ("pixel_values", "image_sizes") if name in batch}


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
