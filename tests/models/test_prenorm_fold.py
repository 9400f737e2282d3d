"""A dense decoder layer's pre-norms folded into the projections that read them (``branch_input``
with ``input_projection``; ``layers.NormedInput``): at one GPU row, one launch computes the residual
add, the norm and the product, and the layer's outputs are those of the separate ops.

The fold applies to single GPU rows only; on the CPU it is switched on by letting ``Linear.folds_norm``
take CPU rows, so the fused op runs as its reference, the composition of the separate ops."""

import pytest
import torch

import layers.linear
import layers.norm
from models import model_class_for
from tests.conftest import tiny_config


def random_model(config, dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    model = model_class_for(config)(config).to(device=device, dtype=dtype)
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight"):
            parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
        else:
            parameter.copy_(0.15 * torch.randn_like(parameter))
    return model.eval()


def count_folds(monkeypatch) -> list:
    calls = []
    fused = layers.norm.fused_add_rms_norm_gemv
    monkeypatch.setattr(layers.norm, "fused_add_rms_norm_gemv", lambda *args: calls.append(args) or fused(*args))
    return calls


CONFIGS = {
    "llama": (tiny_config("llama", num_hidden_layers=3), 5),  # both pre-norms of each layer but the first's input norm
    "qwen3": (tiny_config("qwen3", head_dim=24, num_hidden_layers=3), 5),
    "gemma2": (tiny_config("gemma2", num_hidden_layers=3, head_dim=16), 5),  # offset weights, float32 multiply
    "mixtral": (tiny_config("mixtral", num_hidden_layers=3, num_local_experts=4), 2),  # experts keep their norm
}


@pytest.mark.parametrize("name", CONFIGS)
def test_folded_pre_norms_give_the_separate_ops_outputs(name, monkeypatch):
    config, folds = CONFIGS[name]
    model = random_model(config)
    input_ids = torch.tensor([[5]])
    with torch.no_grad():
        separate = model(input_ids)
        monkeypatch.setattr(layers.linear, "single_gpu_row", lambda x, weight: x.numel() == x.shape[-1])
        calls = count_folds(monkeypatch)
        folded = model(input_ids)
        assert len(calls) == folds
        assert torch.equal(folded, separate)
        calls.clear()
        model(torch.tensor([[5, 6]]))  # two rows: the norms run apart
        assert not calls


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_folded_pre_norms_on_the_gpu(name, monkeypatch):
    config, folds = CONFIGS[name]
    model = random_model(config, torch.bfloat16, "cuda")
    input_ids = torch.tensor([[5]], device="cuda")
    with torch.no_grad():
        calls = count_folds(monkeypatch)
        folded = model(input_ids)
        assert len(calls) == folds
        monkeypatch.setattr(layers.linear, "single_gpu_row", lambda x, weight: False)
        assert torch.equal(folded, model(input_ids))
