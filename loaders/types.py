"""The types every checkpoint format shares: where a checkpoint is (``Source``), its tensors as
lazy references (``TensorRef``), the floating dtype names they may carry, and the error a bad
checkpoint raises."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor at fault."""


class HostMemoryError(MemoryError, ValueError):
    """A model that would not fit the host's available memory, raised before its weights are read; the
    message names the checkpoint, both sizes, and what would make it smaller. A ValueError too: the
    request, not the process, is at fault (the CLI reports it as it reports a bad flag)."""


class NonFiniteWeightWarning(UserWarning):
    """A checkpoint tensor holds NaN or Inf values; ``warnings.simplefilter("error",
    NonFiniteWeightWarning)`` makes loading such a checkpoint an error."""


@dataclass(frozen=True)
class Source:
    """A local checkpoint: a HuggingFace directory, or a GGUF file (``gguf_file`` inside ``directory``)."""

    directory: Path
    gguf_file: str | None = None

    @property
    def path(self) -> Path:
        return self.directory / self.gguf_file if self.gguf_file else self.directory


@dataclass
class TensorRef:
    """A checkpoint tensor not read yet: ``load()`` returns it as a CPU tensor, ``load_part(index)``
    only ``tensor[index]`` (reading only those bytes where the format can: ``read_part``). A tensor
    stored quantised (FP8 blocks, MXFP4) loads dequantised, and keeps its stored form in ``fp8`` or ``mxfp4``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: Path
    load: Callable[[], torch.Tensor]
    nbytes: int
    fp8: "Fp8Blocks | None" = None
    mxfp4: "Mxfp4Blocks | None" = None
    read_part: Callable[[tuple], torch.Tensor] | None = None

    def load_part(self, index: tuple) -> torch.Tensor:
        if self.read_part is None:
            return self.load()[index]
        return self.read_part(index)

    def load_parts(self, indices: list[tuple]) -> list[torch.Tensor]:
        """``tensor[index]`` for each index (``()``: the whole tensor); where no part can be read
        alone (a tensor dequantised from FP8 blocks), the tensor is loaded once for all of them."""
        if self.read_part is not None and () not in indices:
            return [self.load_part(index) for index in indices]
        tensor = self.load()
        return [tensor[index] if index else tensor for index in indices]


@dataclass(frozen=True)
class Fp8Blocks:
    """An FP8 block-quantised tensor as stored: the float8_e4m3fn ``weight`` and its float32
    ``scale_inv``, one scale per ``block`` (rows, columns) of the weight's last two dimensions."""

    weight: TensorRef
    scale_inv: TensorRef
    block: tuple[int, int]


@dataclass(frozen=True)
class Mxfp4Blocks:
    """An MXFP4 tensor as stored (``loaders/mxfp4.py``): its uint8 ``blocks`` [..., rows, groups, 16] and
    ``scales`` [..., rows, groups]; its dequantised ``TensorRef`` is [..., groups * 32, rows]."""

    blocks: TensorRef
    scales: TensorRef


# The floating dtypes a checkpoint tensor may carry, by their safetensors names.
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
DTYPE_NAMES = {dtype: name for name, dtype in FLOAT_DTYPES.items()}


MAX_LISTED = 10  # names an error lists before it says how many more there are


def name_list(names: list[str], checkpoint: dict[str, TensorRef] | None = None) -> str:
    """The first ``MAX_LISTED`` of ``names`` for an error message, each with its file when
    ``checkpoint`` holds it, then how many more there are."""
    shown = [f"{n} ({checkpoint[n].file.name})" if checkpoint else n for n in names[:MAX_LISTED]]
    more = f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
    return ", ".join(shown) + more
