"""The one generic loader: given a model built on the meta device, check the checkpoint against the
model's declarations, materialise every parameter once in the target dtype/device, fill it.
A checkpoint tensor that already is a whole parameter in the target dtype on the CPU, of a module
that lays out no storage of its own (embeddings, norms, an untied head, a linear layer filled by one
tensor: not a fused q/k/v filled from three, but Phi-3's stacked one), becomes that parameter as
read, with no copy (``keepable``).

FP8 block-quantised weights load dequantised to the model's dtype, except where they stay in FP8
(by default on CUDA devices with FP8 tensor cores): a module that can multiply by FP8 weights names
those parameters in ``fp8_parameters`` (``layers.Linear``'s weight, ``layers.Experts``' two); where
every tensor that fills them is stored in FP8 blocks and each shard covers whole blocks of rows, they
are stored as float8_e4m3fn, their float32 scales in the module's ``<name>_scale_inv`` buffers and
the block in its ``fp8_block`` (``fp8_parameters_kept``).

MXFP4 weights (gpt-oss's experts) on a CUDA device, or where asked (``keep_mxfp4``), stay in MXFP4 in
a module that names them in ``mxfp4_parameters`` (``layers.Experts``' two): where every tensor that
fills them is stored in MXFP4 and each shard takes whole rows of it, they hold the uint8 blocks, their
uint8 scales the module's ``<name>_scales`` buffers, and the module's ``mxfp4`` is set
(``mxfp4_parameters_kept``); elsewhere they load dequantised to the model's dtype."""

import dataclasses
import re
import warnings
from collections import Counter
from typing import NamedTuple

import torch
from torch import nn
from tqdm import tqdm

from layers.weights import OneOf, Shard
from loaders.fp8 import SCALE_SUFFIX
from loaders.mxfp4 import SCALES_SUFFIX as MXFP4_SCALES_SUFFIX
from loaders.types import FLOAT_DTYPES, CheckpointError, HostMemoryError, NonFiniteWeightWarning, TensorRef, name_list
from ops_cuda.fp8 import FP8_CUDA_CAPABILITY, FP8_DTYPE, block_scale_shape
from ops_cuda.mxfp4 import GROUP_SIZE as MXFP4_GROUP_SIZE
from ops_cuda.mxfp4 import packed_shapes

# The values the check for NaN and Inf masks at once.
FINITE_CHECK_ELEMENTS = 1 << 24
# Checkpoints smaller than this load without a progress bar.
PROGRESS_MIN_BYTES = 256 << 20


def load_weights(model: nn.Module, checkpoint: dict[str, TensorRef], dtype: torch.dtype, device: torch.device,
                 keep_fp8: bool | None = None, mmap: bool = True,
                 whole_shapes: dict[str, tuple[int, ...]] | None = None, keep_mxfp4: bool | None = None) -> nn.Module:
    """Fill ``model``, built on the meta device, with the tensors of ``checkpoint``
    (``open_checkpoint``) in ``dtype`` on ``device``; the model's declarations
    (``checkpoint_shards``, ``ignored_checkpoint_keys``, ``checkpoint_aliases``, ``empty_parameter``,
    ``fp8_parameters``) say where each tensor goes. ``keep_fp8``: whether FP8 block-quantised weights
    stay in FP8 where their modules take them (None: on a CUDA device with FP8 tensor cores,
    ``fp8_native``); else they are dequantised to ``dtype``. ``keep_mxfp4``: whether MXFP4 weights stay
    in MXFP4 where their modules take them (None: on CUDA devices, ``mxfp4_native``). ``mmap``:
    parameters may map their file (``keepable``); False copies every tensor, for files that may change
    while the model lives.
    ``whole_shapes``: of a model split over ranks, the whole tensors' shapes (``plan_loading``)."""
    untie_differing(model, checkpoint)
    plan = plan_loading(model, checkpoint, whole_shapes)
    fp8 = fp8_parameters_kept(model, checkpoint, plan) if (fp8_native(device) if keep_fp8 is None else keep_fp8) else {}
    keep_mxfp4 = mxfp4_native(device) if keep_mxfp4 is None else keep_mxfp4
    mxfp4 = mxfp4_parameters_kept(model, checkpoint, plan) if keep_mxfp4 else set()
    mapped = keepable(model, checkpoint, plan, dtype, device) if mmap else set()
    kept = {name: plan[name][0].parameter for name in mapped  # its parameter
            if plan[name][0].parameter not in fp8 and plan[name][0].parameter not in mxfp4}
    materialize(model, dtype, device, skip=set(kept.values()), fp8=fp8, mxfp4=mxfp4)
    if device.type == "cpu":  # CUDA allocates in materialize, and says so; host pages are taken as fill writes
        check_host_memory(model, checkpoint, dtype, keep_mxfp4)
    fill(model, checkpoint, plan, keep=set(kept), fp8=fp8, mxfp4=mxfp4)
    return model.eval()


def declared_layouts(model: nn.Module) -> dict[str, tuple[tuple[Shard, ...], ...]]:
    """parameter name -> the layouts a checkpoint may store it in, in order of preference.

    A layout is a tuple of shards that tiles the parameter: by default the one tensor of the
    parameter's own name; a module's ``checkpoint_shards`` declares fused parameters (a list of
    shards) or several alternative layouts (``OneOf``). Each layout is also accepted in the
    spellings of the model's ``checkpoint_aliases`` (regex rewrites of tensor names, applied in
    order): the spelling after each rewrite, so that a chain of rewrites names several layouts
    (LLaVA's module tree, the layout transformers saves, the hub's). A parameter shared by two
    modules (tied embeddings) goes by its first owner's name and takes the layouts of both, its
    first owner's first: as in transformers, a checkpoint may hold it under either name."""
    layouts: dict[str, tuple[tuple[Shard, ...], ...]] = {}
    first_owner: dict[int, str] = {}
    for param, _, _, name, options in _owners(model):
        owner = first_owner.setdefault(id(param), name)
        layouts[owner] = layouts.get(owner, ()) + tuple(o for o in options if o not in layouts.get(owner, ()))
    return layouts


def _owners(model: nn.Module):
    """(parameter, module, attribute name, parameter name, its layouts) for every module that holds
    a parameter, a shared one once per module (see ``declared_layouts``)."""
    aliases = [(re.compile(pattern), replacement) for pattern, replacement in getattr(model, "checkpoint_aliases", ())]
    for prefix, module in model.named_modules():
        declared = module.checkpoint_shards(prefix) if hasattr(module, "checkpoint_shards") else {}
        for local_name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            name = f"{prefix}.{local_name}" if prefix else local_name
            declaration = declared.get(local_name, [Shard(name)])
            options = list(declaration) if isinstance(declaration, OneOf) else [tuple(declaration)]
            for layout in options:
                covered = sum(param[shard.index].numel() for shard in layout if shard.source is not None)
                assert covered == param.numel(), f"{name}: declared shards cover {covered} of {param.numel()} elements"
            for layout in list(options):
                names = [shard.name for shard in layout]
                for pattern, replacement in aliases:
                    names = [pattern.sub(replacement, n) for n in names]
                    spelled = tuple(dataclasses.replace(shard, name=n) for n, shard in zip(names, layout))
                    if spelled not in options:
                        options.append(spelled)
            yield param, module, local_name, name, tuple(options)


def untie_differing(model: nn.Module, checkpoint: dict[str, TensorRef]) -> None:
    """transformers' rule for tied parameters, on ``model`` built on the meta device: where the
    checkpoint holds a shared parameter under two owners' names (an embedding and its tied head)
    with different values, the config's tie is wrong; the later owner gets a parameter of its own,
    which its tensors fill, with a warning. Equal copies stay tied (a head saved beside the
    embedding it repeats)."""
    owners: dict[int, list[tuple[nn.Module, str, str, tuple[Shard, ...]]]] = {}
    for param, module, local_name, name, options in _owners(model):
        complete = [layout for layout in options if all(shard.name in checkpoint for shard in layout)]
        if complete:
            owners.setdefault(id(param), []).append((module, local_name, name, complete[0]))
    for held in owners.values():
        _, _, first_name, first_layout = held[0]
        for module, local_name, name, layout in held[1:]:
            if _same_values(checkpoint, first_layout, layout):
                continue
            param = getattr(module, local_name)
            setattr(module, local_name, nn.Parameter(torch.empty(param.shape, device="meta"), requires_grad=False))
            files = sorted({str(checkpoint[shard.name].file) for shard in (*first_layout, *layout)})
            warnings.warn(f"{', '.join(files)}: {name} and {first_name} hold different values, but the config ties "
                          f"them (tie_word_embeddings); loaded untied, each from its own tensors, as transformers "
                          f"does", stacklevel=3)


def _same_values(checkpoint: dict[str, TensorRef], layout: tuple[Shard, ...], other: tuple[Shard, ...]) -> bool:
    """Whether two layouts of one parameter fill it with the same values (layouts that tile it in other
    parts count as different: untied, each is filled correctly anyway)."""
    if [(s.index, s.source, s.transposed) for s in layout] != [(s.index, s.source, s.transposed) for s in other]:
        return False
    for shard, other_shard in zip(layout, other):
        if shard.source is None:  # another rank's part
            continue
        ref, other_ref = checkpoint[shard.name], checkpoint[other_shard.name]
        if ref.shape != other_ref.shape or ref.dtype != other_ref.dtype:
            return False
        part, other_part = (r.load_part(shard.source) if shard.source else r.load() for r in (ref, other_ref))
        if not torch.equal(part, other_part):
            return False
    return True


class Target(NamedTuple):
    """A place a checkpoint tensor fills: ``parameter[index]`` from the tensor's part ``source``
    (``Shard.source``), its last two dimensions swapped where ``transposed``."""

    parameter: str
    index: tuple
    source: tuple | None
    transposed: bool = False


def choose_layouts(layouts, checkpoint) -> tuple[dict[str, list[Target]], list[str]]:
    """Per parameter, the first layout the checkpoint holds completely, else the one it holds most
    of. Returns (checkpoint tensor name -> the places it fills: one, or several parts of it in one
    parameter, as a rank's rows of a stacked gate_up), tensors missing; a parameter of which no
    layout has a tensor is missing as "A or B")."""
    targets: dict[str, list[Target]] = {}
    missing: list[str] = []
    for param_name, options in layouts.items():
        names = [list(dict.fromkeys(shard.name for shard in layout)) for layout in options]  # a tensor's parts once
        held = [sum(name in checkpoint for name in layout) for layout in names]
        complete = [o for o, count, n in zip(options, held, names) if count == len(n)]
        layout = complete[0] if complete else options[held.index(max(held))]  # ties go to the earlier
        if max(held) == 0 and len(options) > 1:
            missing.append(" or ".join(n[0] + (f" (+{len(n) - 1} more)" if len(n) > 1 else "") for n in names))
        else:
            missing += [name for name in dict.fromkeys(shard.name for shard in layout) if name not in checkpoint]
        for shard in layout:
            places = targets.setdefault(shard.name, [])
            assert all(place[0] == param_name for place in places), f"{shard.name} declared for two parameters"
            places.append(Target(param_name, shard.index, shard.source, shard.transposed))
    return targets, missing


def tensor_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The shape of every checkpoint tensor ``model``'s layouts read whole, as the parameters it fills
    declare it: of a model before ``layers.tensor_parallel`` splits it, the whole tensors that its
    ranks read parts of. (A tensor the model itself reads in parts, GPT-OSS's gate and up columns,
    has the shape of each part checked instead.)"""
    return {shard.name: _swapped(tuple(param[shard.index].shape), shard.transposed)
            for param, _, _, _, options in _owners(model) for layout in options for shard in layout
            if shard.source == ()}


def _swapped(shape: tuple[int, ...], transposed: bool) -> tuple[int, ...]:
    return (*shape[:-2], shape[-1], shape[-2]) if transposed else shape


def plan_loading(model: nn.Module, checkpoint: dict[str, TensorRef],
                 whole_shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, list[Target]]:
    """Check names, shapes and dtypes before any tensor is read; raise one error listing every problem
    (one per tensor). Returns the tensors this rank reads: not those its layouts name as another
    rank's (``Shard.elsewhere``). ``whole_shapes`` (``tensor_shapes`` of the model before it was
    split): a tensor this rank reads a part of must have its whole shape too, or a larger tensor's
    part would load without a word."""
    targets, missing = choose_layouts(declared_layouts(model), checkpoint)
    ignored = [re.compile(pattern) for pattern in getattr(model, "ignored_checkpoint_keys", ())]
    tied = ({name for name, _ in model.named_parameters(remove_duplicate=False)}
            - {place[0] for places in targets.values() for place in places})

    problems = []
    unexpected = [
        name for name in checkpoint
        if name not in targets and name not in tied and not any(p.search(name) for p in ignored)
    ]
    if unexpected:
        problems.append(f"unexpected tensors (no parameter takes them): {name_list(unexpected, checkpoint)}")
    if missing:
        problems.append(f"missing tensors: {name_list(missing)}")
    targets = {name: read for name, places in targets.items()
               if (read := [p for p in places if p.source is not None])}
    for name, places in targets.items():
        ref = checkpoint.get(name)
        if ref is None:
            continue
        if problem := _shape_problem(model, ref, places, (whole_shapes or {}).get(name)):
            problems.append(f"tensor {name!r} in {ref.file}: {problem}")
        if ref.dtype not in FLOAT_DTYPES:
            problems.append(f"tensor {name!r} in {ref.file}: dtype {ref.dtype} is not a floating-point type")
    if problems:
        raise CheckpointError(f"checkpoint does not match {type(model).__name__}:\n  " + "\n  ".join(problems))
    return targets


def _shape_problem(model: nn.Module, ref: TensorRef, places: list[Target], whole: tuple[int, ...] | None) -> str | None:
    """What is wrong with the shape of ``ref`` for the places it fills, if anything."""
    for param_name, index, source, transposed in places:
        expected = _swapped(tuple(model.get_parameter(param_name)[index].shape), transposed)
        if not source:
            if ref.shape != expected:
                return f"expected shape {expected}, got {ref.shape}"
            continue
        if whole is not None and ref.shape != whole:
            return f"expected shape {whole} (of which this rank reads a part), got {ref.shape}"
        try:
            part = tuple(torch.empty(ref.shape, device="meta")[source].shape)
        except IndexError:
            part = None
        if part != expected:
            return (f"the part {source} this rank reads has shape {part}, expected {expected} "
                    f"(the whole tensor: {ref.shape})")
    return None


def keepable(model: nn.Module, checkpoint: dict[str, TensorRef], targets: dict[str, list[Target]], dtype,
             device) -> set[str]:
    """The checkpoint tensors ``fill`` keeps as their parameter instead of copying them: each fills
    a whole parameter alone (not a shard of a fused or stacked one), is stored in the target dtype,
    the target is the CPU, and the owning module lays out no storage of its own (``empty_parameter``).
    A safetensors tensor kept this way is a copy-on-write map of its file, read on first use (as
    HuggingFace's loader does): the file must not be truncated or overwritten in place while the
    model lives (a truncated mapping ends the process with SIGBUS); ``load_weights(mmap=False)``
    copies instead."""
    if device.type != "cpu":
        return set()
    shards = Counter(place.parameter for places in targets.values() for place in places)
    return {
        name for name, [(param_name, index, source, transposed), *others] in targets.items()
        if not others and index == () and source == () and not transposed and shards[param_name] == 1
        and name in checkpoint
        and FLOAT_DTYPES.get(checkpoint[name].dtype) == dtype
        and not hasattr(model.get_submodule(param_name.rpartition(".")[0]), "empty_parameter")
    }


def fp8_native(device: torch.device) -> bool:
    """Whether FP8 weights stay FP8 on ``device`` by default: on CUDA devices with FP8 tensor cores
    (sm89 onward), where the FP8 ops have kernels; elsewhere they would dequantise at every call."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CUDA_CAPABILITY


def check_host_memory(model: nn.Module, checkpoint: dict[str, TensorRef], dtype: torch.dtype, kept_mxfp4: bool) -> None:
    """Raise a ``HostMemoryError`` where the storage ``materialize`` gave the model on the CPU (not yet
    written; parameters that will map their file are not counted) exceeds the memory the host has
    available (``available_host_memory``): ``fill`` would otherwise be killed part-way through, without
    a word."""
    available = available_host_memory()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()] if t.device.type == "cpu"}
    needed = sum(storages.values())
    if available is None or needed <= available:
        return
    smaller = []
    if not kept_mxfp4 and any(ref.mxfp4 is not None for ref in checkpoint.values()):
        smaller.append("keep_mxfp4=True (--keep-mxfp4) keeps its MXFP4 experts in about a quarter of their bytes")
    if dtype.itemsize > 2:
        smaller.append(f"a 16-bit dtype (--dtype bfloat16) halves {dtype}'s bytes")
    files = {ref.file for ref in checkpoint.values()}
    where = str(files.pop()) if len(files) == 1 else ", ".join(sorted({str(file.parent) for file in files}))
    raise HostMemoryError(f"{where}: the model needs {needed / 2**30:.1f} GiB of memory in {dtype} on "
                          f"the CPU, and {available / 2**30:.1f} GiB are available"
                          + "".join(f"; {hint}" for hint in smaller))


def available_host_memory() -> int | None:
    """Bytes of memory the host can give without swapping (Linux's ``MemAvailable``); None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def mxfp4_native(device: torch.device) -> bool:
    """Whether MXFP4 weights stay MXFP4 on ``device`` by default: on CUDA, in a quarter of the memory of
    bf16, where decode steps of up to a hundred-odd tokens run faster than over bf16 weights and prompts
    slower (docs/performance.md); on the CPU the reference would dequantise the picked experts at every
    call."""
    return device.type == "cuda"


def fp8_parameters_kept(model: nn.Module, checkpoint: dict[str, TensorRef],
                        targets: dict[str, list[Target]]) -> dict[str, tuple[int, int]]:
    """parameter name -> scale block, for the parameters that stay in FP8: those a module names in its
    ``fp8_parameters``, all of them or none per module, each filled only by whole FP8 block-quantised
    tensors (not a rank's part, ``Shard.source``) whose shards cover whole blocks of the parameter's
    rows (``scale_index``)."""
    shards: dict[str, list[tuple[TensorRef | None, tuple]]] = {}
    for name, places in targets.items():
        for param_name, index, source, transposed in places:
            # A rank's part of a tensor loads dequantised: its scales would need the same cut.
            whole = source == () and not transposed
            shards.setdefault(param_name, []).append((checkpoint[name] if whole else None, index))
    kept = {}
    for prefix, module in model.named_modules():
        names = [f"{prefix}.{local}" if prefix else local for local in getattr(module, "fp8_parameters", ())]
        blocks = {}
        for name in names:
            refs = shards.get(name, [])
            shape = model.get_parameter(name).shape
            if refs and all(ref is not None and ref.fp8 is not None
                            and scale_index(index, shape, ref.fp8.block) is not None for ref, index in refs):
                blocks[name] = refs[0][0].fp8.block
        if names and len(blocks) == len(names):
            kept.update(blocks)
    return kept


def scale_index(index: tuple, shape: torch.Size, block: tuple[int, int]) -> tuple | None:
    """Where the scales of the shard at ``index`` of a parameter of ``shape`` go in the parameter's
    scales: the same index over the leading dimensions, its rows in blocks. None where the shard
    does not cover whole blocks (it cuts the columns, or a block of rows)."""
    rows_dim = len(shape) - 2
    result = []
    for dim, part in enumerate(index):
        if dim < rows_dim:
            result.append(part)
            continue
        if dim > rows_dim or not isinstance(part, slice):
            return None
        start, stop, step = part.indices(shape[dim])
        if step != 1 or start % block[0] or (stop % block[0] and stop != shape[dim]):
            return None
        result.append(slice(start // block[0], -(-stop // block[0])))
    return tuple(result)


def mxfp4_parameters_kept(model: nn.Module, checkpoint: dict[str, TensorRef],
                          targets: dict[str, list[Target]]) -> set[str]:
    """The parameters that stay in MXFP4: those a module names in its ``mxfp4_parameters``, all of them
    or none per module, each filled only by MXFP4 tensors read transposed (the stored rows become the
    parameter's rows) in whole rows (``mxfp4_source``) into places that leave the parameter's columns
    whole, its columns whole scale groups."""
    sources: dict[str, list[tuple | None]] = {}
    for name, places in targets.items():
        ref = checkpoint[name]
        for place in places:
            whole_columns = len(place.index) < model.get_parameter(place.parameter).dim()
            stored = ref.mxfp4 is not None and place.transposed and whole_columns
            sources.setdefault(place.parameter, []).append(mxfp4_source(place.source, len(ref.shape)) if stored else None)
    kept = set()
    for prefix, module in model.named_modules():
        names = [f"{prefix}.{local}" if prefix else local for local in getattr(module, "mxfp4_parameters", ())]
        if names and all(sources.get(name) and None not in sources[name]
                         and model.get_parameter(name).shape[-1] % MXFP4_GROUP_SIZE == 0 for name in names):
            kept.update(names)
    return kept


def mxfp4_source(source: tuple, ndim: int) -> tuple | None:
    """The index into an MXFP4 tensor's stored blocks [..., rows, groups, 16] and scales [..., rows, groups]
    of a transposed read of ``source`` from its dequantised [..., columns, rows]: the same leading
    index and rows; None where ``source`` cuts the columns (a group's values would part)."""
    if source == ():
        return ()
    index = (*source, *[slice(None)] * (ndim - len(source)))
    return None if index[-2] != slice(None) else (*index[:-2], index[-1])


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device, skip: set[str] = frozenset(),
                fp8: dict[str, tuple[int, int]] | None = None, mxfp4: set[str] = frozenset()) -> None:
    """Replace every meta parameter by uninitialised storage, once per shared parameter, except the
    parameters named in ``skip`` (``fill`` gives them the checkpoint's tensor); those named in
    ``fp8`` (see ``fp8_parameters_kept``) in float8_e4m3fn, with their scales; those named in ``mxfp4``
    (``mxfp4_parameters_kept``) as uint8 blocks, with their scales. Move computed buffers (they were
    built on the CPU) to the device."""
    replaced: dict[int, nn.Parameter] = {}
    skipped = {id(model.get_parameter(name)) for name in skip}
    fp8_blocks = {id(model.get_parameter(name)): block for name, block in (fp8 or {}).items()}
    mxfp4_ids = {id(model.get_parameter(name)) for name in mxfp4}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if id(param) in skipped:
                continue
            if id(param) in fp8_blocks:
                block = fp8_blocks[id(param)]
                storage = torch.empty(param.shape, dtype=FP8_DTYPE, device=device)
                scales = torch.empty(block_scale_shape(param.shape, block), dtype=torch.float32, device=device)
                setattr(module, name + SCALE_SUFFIX, scales)
                module.fp8_block = block
                replaced[id(param)] = nn.Parameter(storage, requires_grad=False)
            if id(param) in mxfp4_ids:
                blocks_shape, scales_shape = packed_shapes(tuple(param.shape))
                scales = torch.empty(scales_shape, dtype=torch.uint8, device=device)
                setattr(module, name + MXFP4_SCALES_SUFFIX, scales)
                module.mxfp4 = True
                replaced[id(param)] = nn.Parameter(torch.empty(blocks_shape, dtype=torch.uint8, device=device),
                                                   requires_grad=False)
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
    targets: dict[str, list[Target]],
    progress=None,
    keep: set[str] = frozenset(),
    fp8: dict[str, tuple[int, int]] | None = None,
    mxfp4: set[str] = frozenset(),
):
    """Copy every checkpoint tensor into its places; a tensor named in ``keep`` (see ``keepable``)
    becomes its parameter as read, in every module that shares that parameter; one filling a
    parameter named in ``fp8`` or ``mxfp4`` is copied as stored, its scales into the module's scales."""
    names = [name for name in checkpoint if name in targets]
    total = sum(checkpoint[name].nbytes for name in names)
    show = progress if progress is not None else total >= PROGRESS_MIN_BYTES
    holders = _holders(model) if keep else {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="Loading weights", disable=not show) as bar:
        for name in names:
            ref = checkpoint[name]
            places = targets[name]  # all in one parameter
            param_name = places[0].parameter
            if fp8 and param_name in fp8:  # copied as stored: never dequantised
                stored, parameter = ref.fp8, model.get_parameter(param_name)
                weight, scale_inv = stored.weight.load(), stored.scale_inv.load()
                _warn_if_not_finite(ref, weight)
                _warn_if_not_finite(ref, scale_inv)
                scales = model.get_buffer(param_name + SCALE_SUFFIX)
                for place in places:
                    parameter[place.index].copy_(weight)
                    scales[scale_index(place.index, parameter.shape, stored.block)].copy_(scale_inv)
                bar.update(ref.nbytes)
                continue
            if param_name in mxfp4:  # copied as stored: never dequantised
                stored, parameter = ref.mxfp4, model.get_parameter(param_name)
                scales = model.get_buffer(param_name + MXFP4_SCALES_SUFFIX)
                indices = [mxfp4_source(place.source, len(ref.shape)) for place in places]
                for place, blocks, group_scales in zip(places, stored.blocks.load_parts(indices),
                                                       stored.scales.load_parts(indices)):
                    _warn_if_not_finite(ref, group_scales)
                    parameter[place.index].copy_(blocks.flatten(-2))
                    scales[place.index].copy_(group_scales)
                bar.update(ref.nbytes)
                continue
            for place, tensor in zip(places, ref.load_parts([place.source for place in places])):
                _warn_if_not_finite(ref, tensor)
                if name in keep:
                    tensor = tensor.to(FLOAT_DTYPES[ref.dtype]).contiguous()  # no-ops, unless a reader surprises
                    if tuple(tensor.shape) != ref.shape:
                        raise CheckpointError(f"tensor {name!r} in {ref.file}: read with shape "
                                              f"{tuple(tensor.shape)}, declared {ref.shape}")
                    kept = nn.Parameter(tensor, requires_grad=False)
                    for module, local_name in holders[id(model.get_parameter(param_name))]:
                        setattr(module, local_name, kept)
                else:
                    model.get_parameter(param_name)[place.index].copy_(tensor.mT if place.transposed else tensor)
            bar.update(ref.nbytes)


def _warn_if_not_finite(ref: TensorRef, tensor: torch.Tensor) -> None:
    # NaN or Inf in a weight makes every logit NaN: the output would be token 0 with no sign why.
    # One pass, no mask, for a finite tensor: NaN carries through min and max, an infinity is one of them
    # (a tenth of the time of a mask of every value).
    if tensor.numel() == 0 or (tensor.is_floating_point() and tensor.dtype != FP8_DTYPE
                               and all(map(torch.isfinite, torch.aminmax(tensor)))):
        return
    # Counted a slice of rows at a time: the mask of a whole stack of experts would take gigabytes.
    rows = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() > 1 else tensor.reshape(1, -1)
    step = max(1, FINITE_CHECK_ELEMENTS // max(1, rows.shape[1]))
    bad = sum(part.numel() - int(torch.count_nonzero(_finite(part))) for part in rows.split(step))
    if bad:
        warnings.warn(f"tensor {ref.name!r} in {ref.file}: {bad} of {tensor.numel()} values are NaN or Inf",
                      NonFiniteWeightWarning, stacklevel=3)


def _finite(values: torch.Tensor) -> torch.Tensor:
    # float8_e4m3fn has no infinities; its NaNs are the bytes 0x7f and 0xff. MXFP4's values are codes
    # and its scales e8m0 exponents: 0xff is NaN (a scale of 2^128, as transformers dequantises it, infinite).
    if values.dtype == FP8_DTYPE:
        return (values.view(torch.uint8) & 0x7F) != 0x7F
    if values.dtype == torch.uint8:
        return values != 0xFF
    return torch.isfinite(values)


def _holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(parameter) -> every (module, attribute name) that holds it (two for a tied embedding)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for local_name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(param), []).append((module, local_name))
    return holders
