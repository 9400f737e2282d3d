"""FP8 block-quantised checkpoints (DeepSeek-V3's format): dequantised on load into the model's
dtype, equal to a twin checkpoint holding the dequantised weights, and strict about their scales
and their quantization_config. Kept in FP8 (``keep_fp8=True``, the default on CUDA; here on the
CPU, where the FP8 ops run their references): the weights and scales as stored, in the layers that
take them, and the same logits and greedy tokens as the twin."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from loaders import CheckpointError
from loaders.load import scale_index
from models import AutoModelForCausalLM
from runtime import LLM
from runtime.diff import diff_models, load_reference
from tests.conftest import hf_model, relative_error, tiny_config
from tests.loaders.test_errors import rewrite_tensors
from tests.models.test_deepseek_v3 import deepseek_config, deepseek_hf_model
from tests.models.test_moe import QWEN3_MOE, per_expert_state_dict
from tests.runtime.test_runtime import GREEDY, prompts, token_ids

# Not square, so swapped block axes show; 64 and 112 columns or rows leave partial edge blocks.
BLOCK = (32, 48)
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
TOKENS = torch.tensor([[5, 17, 3, 88, 42, 7, 1, 60, 23, 9, 14]])


def quantise(weight: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale_inv, dequantised weight) of a [..., rows, cols] weight, block by block."""
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    fp8 = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    scale_inv = torch.empty((*weight.shape[:-2], *grid), device=weight.device)
    dequantised = torch.empty(weight.shape, device=weight.device)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = (..., slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            scale = weight[part].abs().amax(dim=(-2, -1)) / FP8_MAX
            scale_inv[..., i, j] = scale
            fp8[part] = (weight[part] / scale[..., None, None]).to(torch.float8_e4m3fn)
            dequantised[part] = fp8[part].float() * scale[..., None, None]
    return fp8, scale_inv, dequantised


def quantised(name: str) -> bool:
    """The decoder's linear weights, as DeepSeek quantises them; embeddings, norms, routers and lm_head stay."""
    return (name.startswith("model.layers.") and name.endswith(("_proj.weight", "_proj", "_proj_with_mqa.weight"))
            and "norm" not in name)


def write_pair(model, tensors: dict[str, torch.Tensor], path, quantization=QUANTIZATION):
    """An FP8 checkpoint of ``tensors`` at ``path / "fp8"`` (in blocks of ``quantization``'s
    weight_block_size) and its dequantised float32 twin at ``path / "twin"``."""
    block = tuple(quantization["weight_block_size"])
    fp8_tensors, twin_tensors = {}, {}
    for name, tensor in tensors.items():
        if quantised(name):
            fp8_tensors[name], fp8_tensors[name + "_scale_inv"], twin_tensors[name] = quantise(tensor, block)
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
    assert_same_logits(ours, theirs)


def assert_same_logits(ours, theirs):
    """The FP8 checkpoint's logits against its twin's. bfloat16 weights are copies on both sides:
    the same bits. In float32 the twin's unfused weights are mapped from its file, at another
    alignment than the dequantised copies, which changes how MKL's kernels sum."""
    if ours.dtype == torch.bfloat16:
        assert torch.equal(ours, theirs)
    else:
        assert relative_error(ours, theirs) < 1e-6


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
    assert_same_logits(logits(fp8, torch.float32), logits(twin, torch.float32))


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


# Kept in FP8 ---------------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn
# float32 logits of FP8 weights kept against their twin's: the same dequantised values multiplied,
# by F.linear on one side and as W x^T (ops_cuda.linear) on the other: another summation order.
KEPT_TOL = 1e-5


def assert_kept(module, name: str, stored: dict[str, torch.Tensor], *sources: str):
    """``module.<name>`` is the FP8 tensors ``sources`` stacked along their rows as stored, and its
    scales theirs."""
    weight, scales = getattr(module, name), getattr(module, name + "_scale_inv")
    assert weight.dtype == FP8 and scales.dtype == torch.float32
    assert torch.equal(weight.view(torch.uint8), torch.cat([stored[s] for s in sources], dim=-2).view(torch.uint8))
    assert torch.equal(scales, torch.cat([stored[s + "_scale_inv"] for s in sources], dim=-2))


def test_llama_weights_kept_in_fp8_where_shards_cover_whole_blocks(llama_pair):
    fp8, twin = llama_pair
    model = AutoModelForCausalLM.from_pretrained(fp8, keep_fp8=True)
    stored = load_file(fp8 / "model.safetensors")
    layer, prefix = model.model.layers[1], "model.layers.1."
    # q (64 rows), k and v (32 each) start on 32-row blocks: one FP8 weight, their scales stacked.
    assert_kept(layer.self_attn.qkv_proj, "weight", stored,
                *(f"{prefix}self_attn.{p}_proj.weight" for p in "qkv"))
    assert_kept(layer.mlp.down_proj, "weight", stored, f"{prefix}mlp.down_proj.weight")
    assert layer.mlp.down_proj.fp8_block == BLOCK
    # qkv_proj in FP8 reads no split norm: no block splits its norms, and no product is marked for it.
    assert not any(layer.splits_norms for layer in model.model.layers)
    assert not any(getattr(module, "into_norm", False) for module in model.modules())
    # gate has 112 rows: up would start inside gate's last block, so gate_up is dequantised.
    gate_up = layer.mlp.gate_up_proj
    assert gate_up.weight.dtype == torch.float32 and gate_up.weight_scale_inv is None and gate_up.fp8_block is None
    assert torch.equal(gate_up.weight[:112], load_file(twin / "model.safetensors")[f"{prefix}mlp.gate_proj.weight"])
    # Never quantised: embeddings, norms, the LM head.
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
    with torch.no_grad():
        assert relative_error(model(TOKENS), logits(twin, torch.float32)) < KEPT_TOL


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_qwen3_moe_experts_kept_in_fp8(tmp_path, layout):
    fp8, twin = moe_pair(tmp_path, layout)
    model = AutoModelForCausalLM.from_pretrained(fp8, keep_fp8=True)
    stored = load_file(fp8 / "model.safetensors")
    experts = model.model.layers[0].mlp.experts
    assert experts.fp8_block == BLOCK
    assert not model.model.layers[0].mlp.reads_split_norm  # so its o_proj is not marked for a split norm
    assert not model.model.layers[0].self_attn.o_proj.into_norm
    if layout == "stacked":
        assert_kept(experts, "gate_up_proj", stored, "model.layers.0.mlp.experts.gate_up_proj")
    else:
        for e in (0, 7):
            gate_up = (f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up"))
            assert torch.equal(experts.gate_up_proj[e].view(torch.uint8),
                               torch.cat([stored[n] for n in gate_up]).view(torch.uint8))
            assert torch.equal(experts.down_proj_scale_inv[e], stored[f"model.layers.0.mlp.experts.{e}.down_proj.weight_scale_inv"])
    with torch.no_grad():
        assert relative_error(model(TOKENS), logits(twin, torch.float32)) < KEPT_TOL


@pytest.fixture
def deepseek_pair(tmp_path):
    """A tiny DeepSeek-V3 in blocks of 16 x 32: every expert's gate and up (16 rows each) whole blocks;
    one shared expert (DeepSeek-V3's count), of the routed experts' shape."""
    model = deepseek_hf_model(deepseek_config(n_shared_experts=1))
    return write_pair(model, model.state_dict(), tmp_path, quantization={**QUANTIZATION, "weight_block_size": [16, 32]})


def test_deepseek_v3_kept_in_fp8_generates_the_twins_greedy_tokens(deepseek_pair):
    fp8, twin = deepseek_pair
    model = AutoModelForCausalLM.from_pretrained(fp8, keep_fp8=True)
    attention, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    for linear in (attention.q_a_proj, attention.q_b_proj, attention.kv_a_proj_with_mqa, attention.o_proj,
                   moe.shared_experts.gate_up_proj, model.model.layers[0].mlp.down_proj):
        assert linear.weight.dtype == FP8 and linear.fp8_block == (16, 32)
    assert moe.experts.gate_up_proj.dtype == moe.experts.down_proj.dtype == FP8
    assert moe.experts.takes_shared(moe.shared_experts)  # one op for the routed experts and the shared one
    # The absorbed form reads kv_b_proj's weight itself: dequantised, in the model's dtype.
    assert attention.kv_b_proj.weight.dtype == torch.float32 and attention.kv_b_proj.fp8_block is None
    twin_model = AutoModelForCausalLM.from_pretrained(twin)
    with torch.no_grad():
        assert relative_error(model(TOKENS), twin_model(TOKENS)) < KEPT_TOL
    requests = prompts(count=3, high=20)
    ours = token_ids(LLM(model, tokenizer=None).generate(requests, GREEDY))
    assert ours == token_ids(LLM(twin_model, tokenizer=None).generate(requests, GREEDY))


def test_keep_fp8_false_dequantises(deepseek_pair):
    fp8, _ = deepseek_pair
    model = AutoModelForCausalLM.from_pretrained(fp8, keep_fp8=False)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    moe = model.model.layers[1].mlp
    assert not moe.experts.takes_shared(moe.shared_experts)
    x = torch.randn(2, model.config.hidden_size)
    with pytest.raises(ValueError, match="Experts cannot take this shared expert into its op: it takes an FP8 expert"):
        moe.experts(x, *moe.gate(x), shared=moe.shared_experts)
    assert not [name for name, _ in model.named_buffers() if name.endswith("_scale_inv")]


@pytest.mark.parametrize("index, expected", [
    ((), ()),  # the whole parameter
    ((slice(64, 128),), (slice(2, 4),)),  # rows 64..127 of a [160, K] weight in 32-row blocks
    ((slice(128, 160),), (slice(4, 5),)),
    ((3, slice(0, 32)), (3, slice(0, 1))),  # an expert's gate rows
    ((3,), (3,)),  # an expert's down projection
])
def test_scale_index_of_whole_blocks(index, expected):
    shape = torch.Size([8, 160, 96]) if len(index) == 2 or index == (3,) else torch.Size([160, 96])
    assert scale_index(index, shape, (32, 48)) == expected


def test_scale_index_of_a_shard_that_cuts_a_block():
    assert scale_index((slice(0, 112),), torch.Size([224, 64]), (32, 48)) is None  # ends inside a block
    assert scale_index((slice(112, 224),), torch.Size([224, 64]), (32, 48)) is None  # starts inside one
    assert scale_index((slice(0, 100),), torch.Size([100, 64]), (32, 48)) == (slice(0, 4),)  # the partial edge
    assert scale_index((slice(None), slice(0, 48)), torch.Size([64, 96]), (32, 48)) is None  # cuts the columns
