"""GPT-OSS (GptOssForCausalLM) against HuggingFace, float32 on CPU: logits from checkpoints in transformers'
layout (experts stored input-by-output, gate and up in alternate columns), every part of the architecture
visible in them (attention sinks, the window of alternate layers, the expert and router biases, the clamp
of the SwiGLU), greedy generation through the runtime and the layer-by-layer diff."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from loaders import CheckpointError, HostMemoryError
from models import AutoModelForCausalLM
from runtime import LLM, SamplingParams
from tests.conftest import hf_model, relative_error, save_checkpoint, tiny_config
from tests.models.test_glm4_moe import assert_greedy_and_diff_match_hf
from tests.models.test_parity import TOLERANCE, assert_matches

GPT_OSS = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=16, sliding_window=6,
               eos_token_id=2, max_position_embeddings=128)


def gpt_oss_config(**overrides):
    return tiny_config("gpt_oss", **{**GPT_OSS, **overrides})


VARIANTS = {
    # gpt-oss's layout: YaRN rotary, a 6-token window on every other layer, experts and router with biases
    "gpt_oss": gpt_oss_config(),
    "gpt_oss-top3-mha-three_layers-tied": gpt_oss_config(num_experts_per_tok=3, num_key_value_heads=4,
                                                        num_hidden_layers=3, tie_word_embeddings=True),
    "gpt_oss-default_rope-no_attention_bias": gpt_oss_config(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_bias=False),
}


def gpt_oss_hf_model(config, gate_up_scale: float = 1.0):
    """HF's model with every bias and sink drawn away from its initial value (HF starts the expert biases at
    zero), the experts' gate_up weights scaled by ``gate_up_scale`` (5 puts many products past the clamp)."""
    model = hf_model(config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("_bias", ".sinks")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            if name.endswith("experts.gate_up_proj"):
                param.mul_(gate_up_scale)
    return model


@pytest.fixture
def make_gpt_oss(tmp_path):
    def make(config, gate_up_scale: float = 1.0):
        model = gpt_oss_hf_model(config, gate_up_scale)
        return save_checkpoint(model, tmp_path / "ckpt"), model

    return make


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_huggingface(variant, make_gpt_oss, input_ids):
    path, reference = make_gpt_oss(VARIANTS[variant])
    assert reference.config._attn_implementation == "eager"  # HF's GPT-OSS attends with its sinks eagerly
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)


def test_the_clamp_of_the_experts_activation_matches_huggingface(make_gpt_oss, input_ids):
    """Gate and up products past +-7, where the clamp bends the activation: HF's logits still."""
    path, reference = make_gpt_oss(VARIANTS["gpt_oss"], gate_up_scale=5.0)
    layer = reference.model.layers[0]
    hidden = layer.post_attention_layernorm(torch.randn(40, 64))
    assert (hidden @ layer.mlp.experts.gate_up_proj[0]).abs().gt(7).float().mean() > 0.2
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)


def rewrite_checkpoint(path, rewrite):
    tensors = load_file(path / "model.safetensors")
    save_file({name: rewrite(name, t) for name, t in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})


@pytest.mark.parametrize("part", ["sinks", "expert biases", "router bias", "window", "gate and up interleaved"])
def test_each_part_is_visible_in_the_logits(part, make_gpt_oss, input_ids):
    """Each part dropped or read wrongly moves the logits far past the tolerance: zoo computes every one."""
    path, reference = make_gpt_oss(VARIANTS["gpt_oss"])
    if part == "window":
        fields = json.loads((path / "config.json").read_text())
        fields["layer_types"] = ["full_attention"] * 2
        (path / "config.json").write_text(json.dumps(fields))
    else:
        suffixes = {"sinks": (".sinks",), "expert biases": ("gate_up_proj_bias", "down_proj_bias"),
                    "router bias": ("router.bias",), "gate and up interleaved": ("experts.gate_up_proj",)}[part]

        def rewrite(name, tensor):
            if not name.endswith(suffixes):
                return tensor
            if part == "gate and up interleaved":  # gate columns first, then up: the layout zoo computes in
                return torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1)
            return torch.zeros_like(tensor)

        rewrite_checkpoint(path, rewrite)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert relative_error(model(input_ids), reference(input_ids).logits) > 100 * TOLERANCE


def test_other_swiglu_constants_are_refused(make_gpt_oss):
    path, _ = make_gpt_oss(VARIANTS["gpt_oss"])
    fields = json.loads((path / "config.json").read_text())
    fields["swiglu_limit"] = 5.0
    (path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=r"swiglu_limit=5\.0.*computes with 1\.702 and 7\.0"):
        AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("variant", ["gpt_oss", "gpt_oss-top3-mha-three_layers-tied"])
def test_greedy_matches_hf_generate_and_diff_rows_agree(variant, make_gpt_oss, input_ids):
    assert_greedy_and_diff_match_hf(*make_gpt_oss(VARIANTS[variant]), input_ids)


def quantise_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, columns] -> MXFP4 blocks [..., rows, columns / 32, 16] and scales [..., rows, columns / 32]:
    each group of 32 values scaled by a power of two that brings its largest to at most 6, each value
    rounded to the nearest e2m1 value."""
    from ops_cuda.mxfp4 import E2M1_VALUES, SCALE_BIAS

    groups = weight.reshape(*weight.shape[:-1], -1, 32).float()
    exponents = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100) / 6.0))
    scaled = groups / torch.exp2(exponents)[..., None]
    codes = (scaled[..., None] - torch.tensor(E2M1_VALUES)).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponents + SCALE_BIAS).to(torch.uint8)


def save_mxfp4_checkpoint(reference, path):
    """``reference`` saved with its experts in MXFP4 (quantization_config mxfp4) in gpt-oss's names, its
    expert parameters set to the values transformers' own dequantiser gives them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path = save_checkpoint(reference, path)
    tensors = load_file(path / "model.safetensors")
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = quantise_mxfp4(param.mT)  # stored as [experts, out, in]
                param.copy_(convert_moe_packed_tensors(blocks, scales).float())
                del tensors[name]
                tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    fields = json.loads((path / "config.json").read_text())
    fields["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                        "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(fields))
    return path


def test_an_mxfp4_checkpoint_loads_as_transformers_dequantises_it(tmp_path, input_ids):
    """gpt-oss's own format: the experts in MXFP4 blocks and scales (quantization_config mxfp4). HF's model
    holds the values transformers' own dequantiser gives; zoo, loading the blocks, computes its logits
    (dequantised by default on the CPU), and the same logits with the experts kept in MXFP4
    (``keep_mxfp4``)."""
    reference = gpt_oss_hf_model(VARIANTS["gpt_oss"])
    path = save_mxfp4_checkpoint(reference, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    kept = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, keep_mxfp4=True)
    experts = kept.model.layers[1].mlp.experts
    assert experts.mxfp4 and not model.model.layers[1].mlp.experts.mxfp4
    stored = tensors["model.layers.1.mlp.experts.gate_up_proj_blocks"]  # gate and up rows interleaved
    assert torch.equal(experts.gate_up_proj, torch.cat([stored[:, 0::2], stored[:, 1::2]], dim=1).flatten(-2))
    assert torch.equal(experts.down_proj_scales, tensors["model.layers.1.mlp.experts.down_proj_scales"])
    with torch.no_grad():
        logits = model(input_ids)
        assert_matches(logits, reference(input_ids).logits)
        assert torch.equal(kept(input_ids), logits)  # the picked experts dequantised per call: the same values
    with pytest.raises(TypeError, match="keep_mxfp4 must be None, True or False, got 'yes'"):
        AutoModelForCausalLM.from_pretrained(path, keep_mxfp4="yes")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"down_proj_blocks.*without their scales"):
        AutoModelForCausalLM.from_pretrained(path)


def test_a_host_too_small_for_the_dequantised_experts_is_told_to_keep_them(tmp_path, monkeypatch):
    """Where the model would not fit the host's free memory, the error names keep_mxfp4 while the experts
    would be dequantised, and not once they are kept."""
    path = save_mxfp4_checkpoint(gpt_oss_hf_model(VARIANTS["gpt_oss"]), tmp_path / "ckpt")
    monkeypatch.setattr("loaders.load.available_host_memory", lambda: 0)
    with pytest.raises(HostMemoryError, match=r"GiB are available; keep_mxfp4=True \(--keep-mxfp4\) keeps its MXFP4 "
                                              r"experts in about a quarter of their bytes$"):
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with pytest.raises(HostMemoryError, match=r"GiB are available$"):
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, keep_mxfp4=True)


@pytest.mark.gpu
def test_mxfp4_experts_kept_on_the_gpu_give_transformers_logits_gpu(tmp_path, input_ids):
    """On CUDA the experts stay in MXFP4 by default and run the fused-MoE kernel over blocks and scales
    and, for a single token, the one-token kernels:
    float32 logits (float32 products: tl.dot in full precision) as HF's over its dequantised experts,
    prompts of 40 tokens and single-token steps (the kernel's one-token layout)."""
    reference = gpt_oss_hf_model(VARIANTS["gpt_oss"])
    path = save_mxfp4_checkpoint(reference, tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device="cuda")
    assert model.model.layers[0].mlp.experts.mxfp4
    with torch.no_grad():
        assert_matches(model(input_ids.cuda()).cpu(), reference(input_ids).logits)
        assert_matches(model(input_ids[:1, :1].cuda()).cpu(), reference(input_ids[:1, :1]).logits)


def test_llm_keeps_mxfp4_experts_when_asked(tmp_path):
    """``LLM(path, keep_mxfp4=True)``: the experts in MXFP4, the greedy tokens of the dequantised load."""
    path = str(save_mxfp4_checkpoint(gpt_oss_hf_model(VARIANTS["gpt_oss"]), tmp_path / "ckpt"))
    prompts, greedy = [[5, 9, 13, 2], [40, 41, 42]], SamplingParams(max_tokens=8, temperature=0.0)
    kept = LLM(path, device="cpu", keep_mxfp4=True)
    assert kept.model.model.layers[0].mlp.experts.mxfp4
    dequantised = LLM(path, device="cpu")
    assert not dequantised.model.model.layers[0].mlp.experts.mxfp4
    tokens = [[o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] for llm in (kept, dequantised)]
    assert tokens[0] == tokens[1] and all(len(t) > 0 for t in tokens[0])
    with pytest.raises(TypeError, match="keep_mxfp4 must be None, True or False, got 1"):
        LLM(path, device="cpu", keep_mxfp4=1)
    with pytest.raises(ValueError, match="keep_mxfp4 says how a checkpoint loads"):
        LLM(dequantised.model, keep_mxfp4=True)


@pytest.mark.gpu
def test_llm_with_mxfp4_experts_on_the_gpu_gives_the_dequantised_tokens_gpu(tmp_path):
    """Every path of zoo::mxfp4_moe_experts inside the runtime's CUDA graphs, float32: a prompt of 1,100
    tokens (the experts through bf16 buffers, here float32 ones), a batch of short ones (the fused-MoE
    kernel's MXFP4 tiles) and a prompt alone (single-token decode steps), as the experts dequantised at load
    give."""
    config = gpt_oss_config(max_position_embeddings=2048)
    path = str(save_mxfp4_checkpoint(gpt_oss_hf_model(config), tmp_path / "ckpt"))
    prompts = [[3 + i % 90 for i in range(1100)], [5, 9, 13, 2], [40, 41, 42], [7] * 11]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    tokens = []
    for keep in (True, False):
        llm = LLM(path, device="cuda", dtype="float32", keep_mxfp4=keep, max_model_len=2048)
        assert llm.model.model.layers[0].mlp.experts.mxfp4 == keep
        batch = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        tokens.append(batch + [llm.generate([[8, 8, 8]], greedy, use_tqdm=False)[0].token_ids])  # alone: one token
        del llm
    assert tokens[0] == tokens[1]


def test_mxfp4_reads_keep_whole_groups():
    """The stored blocks' index of a transposed read: leading index and rows kept, the columns (the
    dequantised tensor's second-to-last dimension) whole, or no MXFP4 read (a group's values would part)."""
    from loaders.load import mxfp4_source

    every, evens = slice(None), slice(0, None, 2)
    assert mxfp4_source((), 3) == ()
    assert mxfp4_source((slice(2, 4), every, evens), 3) == (slice(2, 4), evens)  # experts 2-3, the gate rows
    assert mxfp4_source((slice(2, 4),), 3) == (slice(2, 4), every)
    assert mxfp4_source((every, slice(0, 32)), 3) is None
