"""GLM-4.5 (Glm4MoeForCausalLM), GLM-4.7-Flash (Glm4MoeLiteForCausalLM) and dots.llm1 (Dots1ForCausalLM), the
architectures that take DeepSeek-V3's mixture of experts, against HuggingFace, float32 on CPU: logits from
checkpoints with experts per expert (as hub repos ship them) and stacked (transformers 5's layout), the
multi-token-prediction layer skipped on load, greedy generation through the runtime and the layer-by-layer diff."""

import json
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

from loaders import CheckpointError
from models import AutoModelForCausalLM
from runtime import LLM
from runtime.diff import diff_checkpoint
from tests.conftest import relative_error, tiny_config
from tests.models.test_deepseek_v3 import DEEPSEEK, deepseek_hf_model
from tests.models.test_moe import LAYOUTS, make_moe_checkpoint  # noqa: F401 (a fixture)
from tests.models.test_parity import TOLERANCE, assert_matches
from tests.runtime.test_runtime import GREEDY
from tests.runtime.test_runtime import prompts as runtime_prompts

GLM4_MOE = dict(
    head_dim=16, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3, moe_intermediate_size=16,
    n_shared_experts=2, first_k_dense_replace=1, num_hidden_layers=3, routed_scaling_factor=2.5,
    attention_bias=True, use_qk_norm=True, norm_topk_prob=True, eos_token_id=2,
)


def glm4_moe_config(**overrides):
    return tiny_config("glm4_moe", **{**GLM4_MOE, **overrides})


VARIANTS = {
    # GLM-4.5's layout: rotary on half of each head, q/k/v bias, q/k norms, a dense first layer, grouped routing
    "glm4_moe-qk_norm-bias-groups": glm4_moe_config(),
    "glm4_moe-no_qk_norm-no_bias-one_group-no_norm_topk": glm4_moe_config(
        use_qk_norm=False, attention_bias=False, n_group=1, topk_group=1, norm_topk_prob=False,
    ),
    "glm4_moe-full_rotary-all_sparse-tied": glm4_moe_config(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        first_k_dense_replace=0, tie_word_embeddings=True,
    ),
}


# GLM-4.7-Flash: DeepSeek-V3's latent attention and MoE, each layer's MLP kind from mlp_layer_types
LITE = {name: value for name, value in DEEPSEEK.items() if name != "first_k_dense_replace"}
LITE_VARIANTS = {
    "glm4_moe_lite-dense_first": tiny_config("glm4_moe_lite", **LITE, mlp_layer_types=["dense", "sparse", "sparse"]),
    "glm4_moe_lite-dense_between-no_q_lora": tiny_config("glm4_moe_lite", **{**LITE, "q_lora_rank": None},
                                                mlp_layer_types=["sparse", "dense", "sparse"]),
}
VARIANTS.update(LITE_VARIANTS)
# dots.llm1: Qwen3's attention, windowed from layer max_window_layers on; DeepSeek-V3's MoE
DOTS1 = {name: value for name, value in GLM4_MOE.items() if name not in ("attention_bias", "use_qk_norm")}
VARIANTS.update({
    "dots1-window-groups": tiny_config("dots1", **DOTS1, sliding_window=5, max_window_layers=1),
    "dots1-bias-one_group-all_sparse-tied": tiny_config(
        "dots1", **{**DOTS1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0}, attention_bias=True,
        tie_word_embeddings=True),
})


@pytest.fixture
def make_glm4_moe(make_moe_checkpoint):
    """A checkpoint of HF's model with a non-zero score correction bias (deepseek_hf_model's)."""
    return partial(make_moe_checkpoint, make_reference=deepseek_hf_model)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_huggingface(variant, layout, make_glm4_moe, input_ids):
    path, reference = make_glm4_moe(VARIANTS[variant], layout)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)


@pytest.mark.parametrize("field, value", [
    ("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}),
    ("routed_scaling_factor", 1.0),
    ("first_k_dense_replace", 0),
])
def test_declarations_are_visible_in_the_logits(field, value, make_glm4_moe, input_ids):
    """Each setting moves the logits far past the tolerance: dropping one is caught. (A model that
    skipped the q/k norms or the biases would find their tensors unexpected.)"""
    config = VARIANTS["glm4_moe-qk_norm-bias-groups"]
    if field == "first_k_dense_replace":  # a dense first layer has an MLP of its own; start from all sparse
        config = glm4_moe_config(first_k_dense_replace=0)
        value = 1
    path, reference = make_glm4_moe(config)
    set_config_field(path, field, value)
    if field == "first_k_dense_replace":  # the dense MLP's tensors in place of layer 0's experts
        tensors = {name: t for name, t in load_file(path / "model.safetensors").items()
                   if not name.startswith("model.layers.0.mlp.")}
        generator = torch.Generator().manual_seed(1)
        for name, shape in (("gate_proj", (112, 64)), ("up_proj", (112, 64)), ("down_proj", (64, 112))):
            tensors[f"model.layers.0.mlp.{name}.weight"] = torch.randn(shape, generator=generator) * 0.02
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert relative_error(model(input_ids), reference(input_ids).logits) > 100 * TOLERANCE


def set_config_field(path, field, value):
    fields = json.loads((path / "config.json").read_text())
    fields[field] = value
    (path / "config.json").write_text(json.dumps(fields))


@pytest.mark.parametrize("variant", ["glm4_moe-qk_norm-bias-groups", "glm4_moe_lite-dense_first"])
def test_the_prediction_layer_in_the_checkpoint_is_skipped(variant, make_glm4_moe, input_ids):
    """GLM's checkpoints carry ``num_nextn_predict_layers`` (1) layers past ``num_hidden_layers``: a
    field of GLM-4.5's config class, an extra field of GLM-4.7-Flash's config.json."""
    path, reference = make_glm4_moe(VARIANTS[variant])
    tensors = load_file(path / "model.safetensors")
    extra = {name.replace("model.layers.2.", "model.layers.3."): t.clone()
             for name, t in tensors.items() if name.startswith("model.layers.2.")}
    extra.update({"model.layers.3.enorm.weight": torch.ones(64), "model.layers.3.eh_proj.weight": torch.ones(64, 128)})
    save_file({**tensors, **extra}, path / "model.safetensors", metadata={"format": "pt"})
    set_config_field(path, "num_nextn_predict_layers", 1)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)
    set_config_field(path, "num_nextn_predict_layers", 0)  # then layer 3's tensors have no place in the model
    with pytest.raises(ValueError, match=r"model\.layers\.3\."):
        AutoModelForCausalLM.from_pretrained(path)


def test_mlp_layer_types_zoo_cannot_build_are_named(make_glm4_moe):
    path, _ = make_glm4_moe(LITE_VARIANTS["glm4_moe_lite-dense_first"])
    set_config_field(path, "mlp_layer_types", ["dense", "sparse", "moe"])
    with pytest.raises(CheckpointError,
                       match=r"mlp_layer_types must name one of \('dense', 'sparse'\) for each of the 3"):
        AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("variant", [
    "glm4_moe-qk_norm-bias-groups", "glm4_moe_lite-dense_between-no_q_lora", "dots1-window-groups",
])
def test_greedy_matches_hf_generate_and_diff_rows_agree(variant, make_glm4_moe, input_ids):
    assert_greedy_and_diff_match_hf(*make_glm4_moe(VARIANTS[variant]), input_ids)


def assert_greedy_and_diff_match_hf(path, reference, input_ids):
    """Greedy generation through the runtime token for token HF's ``generate``, and every ``zoo diff`` row
    (a prefill and two decode steps) within its tolerance."""
    batch = runtime_prompts(4, seed=0, low=1, high=40)
    outputs = LLM(str(path), device="cpu", block_size=4).generate(batch, GREEDY, use_tqdm=False)
    for prompt, output in zip(batch, outputs):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
        assert output.token_ids == expected.tolist()
    rows = diff_checkpoint(path, input_ids=input_ids[:1, :11], runtime_steps=2)
    assert {row.path.partition("/")[0] for row in rows} == {"prefill", "decode 1", "decode 2"}
    assert all(row.ok for row in rows)
