"""The one generic loader: given a model built on the meta device, check the checkpoint against the
model's declarations, materialise every parameter once in the target dtype/device, fill it.
A checkpoint tensor that already is a whole parameter in the target dtype on the CPU becomes that
parameter as read, with no copy (``keepable``)."""

import re
from collections import Counter

import torch
from torch import nn
from tqdm import tqdm

from layers.weights import OneOf, Shard
from loaders.checkpoint import open_checkpoint
from loaders.types import FLOAT_DTYPES, CheckpointError, Source, TensorRef, name_list

# Checkpoints smaller than this load without a progress bar.
PROGRESS_MIN_BYTES = 256 << 20


def load_weights(model: nn.Module, source: Source, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Fill ``model``, built on the meta device, with the checkpoint at ``source`` in ``dtype`` on
    ``device``; the model's declarations (``checkpoint_shards``, ``ignored_checkpoint_keys``,
    ``checkpoint_aliases``, ``empty_parameter``) say where each tensor goes."""
    checkpoint = open_checkpoint(source, model.config)
    plan = plan_loading(model, checkpoint)
    kept = keepable(model, checkpoint, plan, dtype, device)
    materialize(model, dtype, device, skip={plan[name][0] for name in kept})
    fill(model, checkpoint, plan, keep=kept)
    return model.eval()


def declared_layouts(model: nn.Module) -> dict[str, tuple[tuple[Shard, ...], ...]]:
    """parameter name -> the layouts a checkpoint may store it in, in order of preference.

    A layout is a tuple of shards that tiles the parameter: by default the one tensor of the
    parameter's own name; a module's ``checkpoint_shards`` declares fused parameters (a list of
    shards) or several alternative layouts (``OneOf``). Each layout is also accepted in the
    spellings of the model's ``checkpoint_aliases`` (regex rewrites of tensor names, applied in
    order): the spelling after each rewrite, so that a chain of rewrites names several layouts
    (LLaVA's module tree, the layout transformers saves, the hub's). A parameter shared by two
    modules (tied embeddings) is declared once, by its first owner."""
    aliases = [(re.compile(pattern), replacement) for pattern, replacement in getattr(model, "checkpoint_aliases", ())]
    layouts: dict[str, tuple[tuple[Shard, ...], ...]] = {}
    owners: set[int] = set()
    for prefix, module in model.named_modules():
        declared = module.checkpoint_shards(prefix) if hasattr(module, "checkpoint_shards") else {}
        for local_name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if id(param) in owners:
                continue
            owners.add(id(param))
            name = f"{prefix}.{local_name}" if prefix else local_name
            declaration = declared.get(local_name, [Shard(name)])
            options = list(declaration) if isinstance(declaration, OneOf) else [tuple(declaration)]
            for layout in options:
                covered = sum(param[shard.index].numel() for shard in layout)
                assert covered == param.numel(), f"{name}: declared shards cover {covered} of {param.numel()} elements"
            for layout in list(options):
                names = [shard.name for shard in layout]
                for pattern, replacement in aliases:
                    names = [pattern.sub(replacement, n) for n in names]
                    spelled = tuple(Shard(n, shard.index) for n, shard in zip(names, layout))
                    if spelled not in options:
                        options.append(spelled)
            layouts[name] = tuple(options)
    return layouts


def choose_layouts(layouts, checkpoint) -> tuple[dict[str, tuple[str, tuple]], list[str]]:
    """Per parameter, the first layout the checkpoint holds completely, else the one it holds most
    of. Returns (checkpoint tensor name -> (parameter name, index into it), tensors missing; a
    parameter of which no layout has a tensor is missing as "A or B")."""
    targets: dict[str, tuple[str, tuple]] = {}
    missing: list[str] = []
    for param_name, options in layouts.items():
        held = [sum(shard.name in checkpoint for shard in layout) for layout in options]
        layout = options[held.index(max(held))]  # a complete layout holds the most; ties go to the earlier
        if max(held) == 0 and len(options) > 1:
            missing.append(" or ".join(o[0].name + (f" (+{len(o) - 1} more)" if len(o) > 1 else "") for o in options))
        else:
            missing += [shard.name for shard in layout if shard.name not in checkpoint]
        for shard in layout:
            assert shard.name not in targets, f"{shard.name} declared for {targets[shard.name][0]} and {param_name}"
            targets[shard.name] = (param_name, shard.index)
    return targets, missing


def plan_loading(model: nn.Module, checkpoint: dict[str, TensorRef]) -> dict[str, tuple[str, tuple]]:
    """Check names, shapes and dtypes before any tensor is read; raise one error listing every problem."""
    targets, missing = choose_layouts(declared_layouts(model), checkpoint)
    ignored = [re.compile(pattern) for pattern in getattr(model, "ignored_checkpoint_keys", ())]
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in targets.values()}

    problems = []
    unexpected = [
        name for name in checkpoint
        if name not in targets and name not in tied and not any(p.search(name) for p in ignored)
    ]
    if unexpected:
        problems.append(f"unexpected tensors (no parameter takes them): {name_list(unexpected, checkpoint)}")
    if missing:
        problems.append(f"missing tensors: {name_list(missing)}")
    for name, (param_name, index) in targets.items():
        ref = checkpoint.get(name)
        if ref is None:
            continue
        expected = tuple(model.get_parameter(param_name)[index].shape)
        if ref.shape != expected:
            problems.append(f"tensor {name!r} in {ref.file}: expected shape {expected}, got {ref.shape}")
        if ref.dtype not in FLOAT_DTYPES:
            problems.append(f"tensor {name!r} in {ref.file}: dtype {ref.dtype} is not a floating-point type")
    if problems:
        raise CheckpointError(f"checkpoint does not match {type(model).__name__}:\n  " + "\n  ".join(problems))
    return targets



def keepable(model: nn.Module, checkpoint: dict[str, TensorRef], targets: dict[str, tuple[str, tuple]], dtype,
             device) -> set[str]:
    """The checkpoint tensors ``fill`` keeps as their parameter instead of copying them: each fills
    a whole parameter alone (not a shard of a fused or stacked one), is stored in the target dtype,
    the target is the CPU, and the owning module lays out no storage of its own (``empty_parameter``).
    A safetensors tensor kept this way is a copy-on-write map of its file, read on first use (as
    HuggingFace's loader does): the file must not be overwritten in place while the model lives."""
    if device.type != "cpu":
        return set()
    shards = Counter(param_name for param_name, _ in targets.values())
    return {
        name for name, (param_name, index) in targets.items()
        if index == () and shards[param_name] == 1 and name in checkpoint
        and FLOAT_DTYPES.get(checkpoint[name].dtype) == dtype
        and not hasattr(model.get_submodule(param_name.rpartition(".")[0]), "empty_parameter")
    }


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device, skip: set[str] = frozenset()) -> None:
    """Replace every meta parameter by uninitialised storage, once per shared parameter, except the
    parameters named in ``skip`` (``fill`` gives them the checkpoint's tensor); move computed
    buffers (they were built on the CPU) to the device."""
    replaced: dict[int, nn.Parameter] = {}
    skipped = {id(model.get_parameter(name)) for name in skip}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if id(param) in skipped:
                continue
            if id(param) not in replaced:
                storage = (module.empty_parameter(name, dtype, device) if hasattr(module, "empty_parameter")
                           else torch.empty(param.shape, dtype=dtype, device=device))
                replaced[id(param)] = nn.Parameter(storage, requires_grad=False)
            setattr(module, name, replaced[id(param)])
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, buffer.to(device))


@torch.no_grad()
def fill(
    model: nn.Module,
    checkpoint: dict[str, TensorRef],
    targets: dict[str, tuple[str, tuple]],
    progress=None,
    keep: set[str] = frozenset(),
):
    """Copy every checkpoint tensor into its place; a tensor named in ``keep`` (see ``keepable``)
    becomes its parameter as read, in every module that shares that parameter."""
    names = [name for name in checkpoint if name in targets]
    total = sum(checkpoint[name].nbytes for name in names)
    show = progress if progress is not None else total >= PROGRESS_MIN_BYTES
    holders = _holders(model) if keep else {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="Loading weights", disable=not show) as bar:
        for name in names:
            param_name, index = targets[name]
            if name in keep:
                ref = checkpoint[name]
                tensor = ref.load().to(FLOAT_DTYPES[ref.dtype]).contiguous()  # no-ops, unless a reader surprises
                if tuple(tensor.shape) != ref.shape:
                    raise CheckpointError(f"tensor {name!r} in {ref.file}: read with shape {tuple(tensor.shape)}, declared {ref.shape}")
                kept = nn.Parameter(tensor, requires_grad=False)
                for module, local_name in holders[id(model.get_parameter(param_name))]:
                    setattr(module, local_name, kept)
            else:
                model.get_parameter(param_name)[index].copy_(checkpoint[name].load())
            bar.update(checkpoint[name].nbytes)


def _holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(parameter) -> every (module, attribute name) that holds it (two for a tied embedding)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for local_name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(param), []).append((module, local_name))
    return holders
