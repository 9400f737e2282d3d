"""zoo's model from a HuggingFace model already in memory: the same declarations and checks as a
checkpoint on disk, with the HF model's state dict as the checkpoint."""

from pathlib import Path

import torch
from torch import nn

from loaders.checkpoint import TensorRef
from loaders.load import fill, materialize, plan_loading

_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def model_from_hf(reference: nn.Module, dtype: torch.dtype | None = None, device=None):
    """A zoo model holding a copy of ``reference``'s weights (by default in its dtype and on its device)."""
    from models import model_class_for

    first = next(reference.parameters())
    dtype, device = dtype or first.dtype, torch.device(device or first.device)
    config = reference.config
    with torch.device("meta"):
        model = model_class_for(config, type(reference).__name__)(config)
    source = Path(f"<{type(reference).__name__} in memory>")
    checkpoint = {
        name: TensorRef(name, tuple(t.shape), _DTYPE_NAMES.get(t.dtype, str(t.dtype)), source,
                        (lambda t=t: t.detach()), t.numel() * t.element_size())
        for name, t in reference.state_dict().items()
    }
    plan = plan_loading(model, checkpoint)
    materialize(model, dtype, device)
    fill(model, checkpoint, plan, progress=False)
    return model.eval()
