"""HuggingFace checkpoint directories: model.safetensors, or shards listed by model.safetensors.index.json."""

import json
from pathlib import Path, PurePosixPath

from safetensors import SafetensorError, safe_open

from loaders.types import CheckpointError, TensorRef

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1}


def checkpoint_files(directory: Path) -> list[Path]:
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: not a valid safetensors index (weight_map is not an object)")
        if not weight_map:
            raise CheckpointError(f"{index}: its weight_map lists no tensors")
        for tensor, name in weight_map.items():
            if not _inside(name):
                raise CheckpointError(f"{index}: weight_map entry {tensor!r} names the shard {name!r}, "
                                      f"which is not a file inside the checkpoint directory")
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard files that do not exist: {missing}")
        return files
    if (directory / SINGLE).is_file():
        return [directory / SINGLE]
    pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt*"))
    hint = f" (found {pickles}: pickle files are never loaded; convert them to safetensors)" if pickles else ""
    raise CheckpointError(f"{directory}: no {SINGLE} or {INDEX}{hint}")


def _inside(name) -> bool:
    """A shard name that stays in the checkpoint's directory: a relative path without "..". The
    shard itself may be a link out (the hub cache links each file to its blob)."""
    if not isinstance(name, str) or not name or "\\" in name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc


def safetensors_tensors(directory: Path) -> dict[str, TensorRef]:
    tensors: dict[str, TensorRef] = {}
    for file in checkpoint_files(directory):
        handle = _open(file)
        for name in handle.keys():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} appears in both {tensors[name].file} and {file}")
            view = handle.get_slice(name)
            shape, dtype = tuple(view.get_shape()), view.get_dtype()
            numel = 1
            for size in shape:
                numel *= size
            tensors[name] = TensorRef(
                name, shape, dtype, file, _reader(handle, file, name), numel * _DTYPE_BYTES.get(dtype, 1),
                read_part=_part_reader(handle, file, name),
            )
    return tensors


def _reader(handle, file: Path, name: str):
    def load():
        try:
            return handle.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{file}: cannot read tensor {name!r} ({exc})") from exc

    return load


def _part_reader(handle, file: Path, name: str):
    """Reads ``tensor[index]`` through safetensors' ``get_slice``: only those bytes of the mapped file."""
    def load_part(index: tuple):
        try:
            return handle.get_slice(name)[index]
        except SafetensorError as exc:
            raise CheckpointError(f"{file}: cannot read tensor {name!r} ({exc})") from exc

    return load_part
