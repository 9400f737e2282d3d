"""Tiny random HuggingFace checkpoints, written with ``save_pretrained``, for parity tests."""

import os

import pytest
import torch
import transformers

# Without a GPU, Triton kernels run in Triton's CPU interpreter; it is chosen when a kernel is
# defined, so this must come before any Triton kernel is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    """The one place tests are skipped for the machine they run on: ``gpu`` tests need a CUDA
    device (and kernels compiled for it, not interpreted); ``interpreter`` tests run Triton kernels
    on CPU tensors, which only the interpreter can."""
    cuda = torch.cuda.is_available() and not INTERPRETED
    needs_cuda = pytest.mark.skip(reason="needs a CUDA device")
    needs_interpreter = pytest.mark.skip(reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(needs_cuda)
        if "interpreter" in item.keywords and not INTERPRETED:
            item.add_marker(needs_interpreter)

# Larger than HF's 0.02 so attention is far from uniform and position bugs show in the logits.
INIT_STD = 0.15


def tiny_config(model_type: str = "llama", **overrides):
    fields = dict(
        vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=INIT_STD, tie_word_embeddings=False,
    )
    fields.update(overrides)
    return transformers.AutoConfig.for_model(model_type, **fields)


def hf_model(config, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norm weights start at one; move them so a skipped norm is visible
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    return model


def save_checkpoint(model, path, dtype=torch.float32, **save_kwargs):
    model.to(dtype).save_pretrained(path, **save_kwargs)
    model.to(torch.float32)
    return path


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest difference over the reference's largest magnitude, computed in float32."""
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    return ((ours.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


def every_pair(first, second, alternating) -> list[tuple]:
    """Parameter cases that hold every pair of three choices in half their combinations: each of
    ``first`` with each of ``second``, the two values of ``alternating`` taking turns."""
    return [(a, b, alternating[(i + j) % 2]) for i, a in enumerate(first) for j, b in enumerate(second)]


@pytest.fixture
def make_checkpoint(tmp_path):
    """make_checkpoint(config, dtype=..., **save_kwargs) -> (directory, HF model in float32)."""

    def make(config, dtype=torch.float32, **save_kwargs):
        model = hf_model(config)
        path = save_checkpoint(model, tmp_path / "ckpt", dtype, **save_kwargs)
        return path, model

    return make


@pytest.fixture
def input_ids():
    torch.manual_seed(1)
    return torch.randint(0, 97, (2, 40))


def poison_allocator():
    """Fills cached blocks of PyTorch's CUDA allocator (small and large pools) with every bit set and frees
    them, so an op's torch.empty buffers start as NaN in every float format and -1 in every integer one:
    a row it forgets to write shows in the output as NaN, an index it forgets as no row or no expert."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # drop the cached blocks of earlier runs, which hold finite values
    mib = 1 << 20
    sizes = [mib] * 64 + [4 * mib] * 16 + [32 * mib] * 8 + [256 * mib] * 2 + [1024 * mib]
    poison = [torch.full((size // 4,), -1, dtype=torch.int32, device="cuda") for size in sizes]
    torch.cuda.synchronize()
    del poison
