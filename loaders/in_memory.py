"""A state dict in memory as a checkpoint: the same declarations and checks as one on disk."""

from pathlib import Path

import torch
from torch import nn

from loaders.load import fill, materialize, plan_loading, untie_differing
from loaders.types import DTYPE_NAMES, TensorRef


def copy_weights(model: nn.Module, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 origin: str) -> nn.Module:
    """Fill ``model``, built on the meta device, with a copy of ``state_dict`` in ``dtype`` on
    ``device``; ``origin`` names the state dict's owner in errors."""
    file = Path(origin)
    checkpoint = {
        name: TensorRef(name, tuple(t.shape), DTYPE_NAMES.get(t.dtype, str(t.dtype)), file,
                        (lambda t=t: t.detach()), t.numel() * t.element_size())
        for name, t in state_dict.items()
    }
    untie_differing(model, checkpoint)
    plan = plan_loading(model, checkpoint)
    materialize(model, dtype, device)
    fill(model, checkpoint, plan, progress=False)
    return model.eval()
