"""FP8 block-quantised checkpoints (DeepSeek-V3's format): dequantised on load into the model's
dtype, equal to a twin checkpoint holding the dequantised weights, and strict about their scales
and their quantization_config."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from loaders import CheckpointError
from models import AutoModelForCausalLM
from runtime.diff import diff_models, load_reference
from tests.conftest import hf_model, tiny_config
from tests.loaders.test_errors import rewrite_tensors
from tests.models.test_moe import QWEN3_MOE, per_expert_state_dict

# Not square, so swapped block axes show; 64 and 112 columns or rows leave partial edge blocks.
BLOCK = (32, 48)
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
TOKENS = torch.tensor([[5, 17, 3, 88, 42, 7, 1, 60, 23, 9, 14]])


def quantise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale_inv, dequantised weight) of a [..., rows, cols] weight, block by block."""
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    fp8 = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty((*weight.shape[:-2], *grid))
    dequantised = torch.empty(weight.shape)
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = (..., slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1]))
            scale = weight[block].abs().amax(dim=(-2, -1)) / FP8_MAX
            scale_inv[..., i, j] = scale
            fp8[block] = (weight[block] / scale[..., None, None]).to(torch.float8_e4m3fn)
            dequantised[block] = fp8[block].float() * scale[..., None, None]
    return fp8, scale_inv, dequantised


def quantised(name: str) -> bool:
    """The decoder's linear weights, as DeepSeek quantises them; embeddings, norms, routers and lm_head stay."""
    return name.startswith("model.layers.") and name.endswith(("_proj.weight", "_proj")) and "norm" not in name


def write_pair(model, tensors: dict[str, torch.Tensor], path, quantization=QUANTIZATION):
    """An FP8 checkpoint of ``tensors`` at ``path / "fp8"`` and its dequantised float32 twin at ``path / "twin"``."""
    fp8_tensors, twin_tensors = {}, {}
    for name, tensor in tensors.items():
        if quantised(name):
            fp8_tensors[name], fp8_tensors[name + "_scale_inv"], twin_tensors[name] = quantise(tensor)
        else:
            fp8_tensors[name] = twin_tensors[name] = tensor
    for kind, kind_tensors in [("fp8", fp8_tensors), ("twin", twin_tensors)]:
        (path / kind).mkdir()
        model.config.save_pretrained(path / kind)
        save_file({n: t.contiguous() for n, t in kind_tensors.items()}, path / kind / "model.safetensors",
                  metadata={"format": "pt"})
    edit_config(path / "fp8", lambda fields: fields.update(quantization_config=quantization))
    return path / "fp8", path / "twin"


def edit_config(path, edit):
    fields = json.loads((path / "config.json").read_text())
    edit(fields)
    (path / "config.json").write_text(json.dumps(fields))


@pytest.fixture
def llama_pair(tmp_path):
    model = hf_model(tiny_config("llama"))
    return write_pair(model, model.state_dict(), tmp_path)


def moe_pair(tmp_path, layout):
    model = hf_model(tiny_config("qwen3_moe", **QWEN3_MOE))
    tensors = per_expert_state_dict(model) if layout == "per_expert" else model.state_dict()
    return write_pair(model, tensors, tmp_path)


def logits(path, dtype):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    with torch.no_grad():
        return model(TOKENS)


def test_the_checkpoint_holds_fp8_blocks_with_partial_edges(llama_pair):
    fp8, _ = llama_pair
    tensors = load_file(fp8 / "model.safetensors")
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (64, 112)
    assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 3)
    assert tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (4, 2)
    assert tensors["model.embed_tokens.weight"].dtype == tensors["lm_head.weight"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_logits_equal_the_dequantised_twin(llama_pair, dtype):
    fp8, twin = llama_pair
    ours, theirs = logits(fp8, dtype), logits(twin, dtype)
    assert ours.dtype == dtype
    assert torch.equal(ours, theirs)


def test_weights_are_the_dequantised_blocks(llama_pair):
    fp8, twin = llama_pair
    model = AutoModelForCausalLM.from_pretrained(fp8)
    expected = load_file(twin / "model.safetensors")
    down = model.model.layers[1].mlp.down_proj.weight
    assert torch.equal(down, expected["model.layers.1.mlp.down_proj.weight"])
    stored = load_file(fp8 / "model.safetensors")
    fp8_weight, scale_inv = stored["model.layers.1.mlp.down_proj.weight"], stored["model.layers.1.mlp.down_proj.weight_scale_inv"]
    # The last row block and column block are partial: rows 32..63 and columns 96..111 share one scale.
    assert torch.equal(down[32:, 96:], fp8_weight[32:, 96:].float() * scale_inv[1, 2])


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_qwen3_moe_experts_equal_the_dequantised_twin(tmp_path, layout):
    fp8, twin = moe_pair(tmp_path, layout)
    if layout == "per_expert":
        assert "model.layers.0.mlp.experts.7.down_proj.weight_scale_inv" in load_file(fp8 / "model.safetensors")
    ours, theirs = AutoModelForCausalLM.from_pretrained(fp8), AutoModelForCausalLM.from_pretrained(twin)
    for (name, weight), (_, expected) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert torch.equal(weight, expected), name
    # In float32 a stacked tensor of the twin is kept as mapped from its file, at another alignment
    # than the dequantised one, which changes how vectorised kernels sum; bf16 weights are copies on both sides.
    assert torch.equal(logits(fp8, torch.bfloat16), logits(twin, torch.bfloat16))


def test_diff_against_huggingface_on_the_twin(llama_pair):
    fp8, twin = llama_pair
    model = AutoModelForCausalLM.from_pretrained(fp8)
    rows = diff_models(model, load_reference(twin, torch.float32, "cpu"), TOKENS)
    assert rows[-1].path == "logits" and len(rows) == 14
    assert all(r.ok and r.relative < 1e-5 for r in rows)


def test_modules_to_not_convert_that_are_not_fp8_load(llama_pair):
    fp8, twin = llama_pair
    edit_config(fp8, lambda fields: fields["quantization_config"].update(modules_to_not_convert=["lm_head", "gate"]))
    assert torch.equal(logits(fp8, torch.float32), logits(twin, torch.float32))


def test_fp8_weight_in_a_module_not_to_convert(llama_pair):
    fp8, _ = llama_pair
    edit_config(fp8, lambda fields: fields["quantization_config"].update(modules_to_not_convert=["lm_head", "model.layers.1"]))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.q_proj\.weight' in .*model\.safetensors: "
                                              r"stored in FP8, but .*modules_to_not_convert"):
        AutoModelForCausalLM.from_pretrained(fp8)


def test_missing_scale(llama_pair):
    fp8, _ = llama_pair
    rewrite_tensors(fp8, lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale_inv"))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' in .*model\.safetensors: "
                                              r"FP8 without its scale 'model\.layers\.1\.mlp\.up_proj\.weight_scale_inv'"):
        AutoModelForCausalLM.from_pretrained(fp8)


def test_scale_of_the_wrong_block_shape(llama_pair):
    fp8, _ = llama_pair
    rewrite_tensors(fp8, lambda t: t.update({"model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(2, 2)}))
    with pytest.raises(CheckpointError, match=r"scale 'model\.layers\.0\.mlp\.down_proj\.weight_scale_inv' in .*model\.safetensors: "
                                              r"expected shape \(2, 3\) for .* \(64, 112\) in blocks of \[32, 48\], got \(2, 2\)"):
        AutoModelForCausalLM.from_pretrained(fp8)


def test_scale_without_its_weight(llama_pair):
    fp8, twin = llama_pair
    dequantised = load_file(twin / "model.safetensors")["model.layers.0.self_attn.o_proj.weight"]
    rewrite_tensors(fp8, lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": dequantised}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*model\.layers\.0\.self_attn\.o_proj\.weight_scale_inv "
                                              r"\(model\.safetensors\)"):
        AutoModelForCausalLM.from_pretrained(fp8)


def test_fp8_tensors_without_a_quantization_config(llama_pair):
    fp8, _ = llama_pair
    edit_config(fp8, lambda fields: fields.pop("quantization_config"))
    with pytest.raises(CheckpointError, match=r"config\.json has no quantization_config, but the checkpoint holds 14 FP8 "
                                              r"\(F8_E4M3\) tensors: model\.layers\.0\.\w+\.\w+\.weight \(model\.safetensors\), .* and 4 more"):
        AutoModelForCausalLM.from_pretrained(fp8)


@pytest.mark.parametrize("field, value", [
    ("quant_method", "awq"), ("fmt", "e5m2"), ("activation_scheme", "static"), ("weight_block_size", [128]),
    ("weight_block_size", [128, 128.0]), ("weight_block_size", None),
])
def test_unsupported_quantization_config(llama_pair, field, value):
    fp8, _ = llama_pair
    edit_config(fp8, lambda fields: fields["quantization_config"].update({field: value}))
    with pytest.raises(CheckpointError, match=rf"config\.json: quantization_config .*{field}.* {re.escape(repr(value))} is not supported; "
                                              r"zoo takes quant_method 'fp8' with .*'fmt': 'e4m3'.* and weight_block_size"):
        AutoModelForCausalLM.from_pretrained(fp8)


def test_another_quantization_method_on_an_unquantised_checkpoint(llama_pair):
    _, twin = llama_pair
    edit_config(twin, lambda fields: fields.update(quantization_config={"quant_method": "awq", "bits": 4}))
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config quant_method 'awq' is not supported"):
        AutoModelForCausalLM.from_pretrained(twin)
